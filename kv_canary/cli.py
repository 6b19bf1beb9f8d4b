"""The `kv-canary` command (also `python -m kv_canary`): the codegen subcommands plus `demo`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .codegen.cli import add_codegen_commands, run


def run_demo(argv: list[str]) -> int:
    from . import demo  # imported lazily: the codegen subcommands must not pay for torch

    return demo.main(argv) or 0


def installed_layout() -> str:
    """LAYOUT.md of the default generated layer (what `describe` renders), for use outside a checkout."""
    from .codegen.render import split_header
    from .layer.loader import default_generated_dir

    text = (default_generated_dir() / "LAYOUT.md").read_text(encoding="utf-8")
    parsed = split_header(text)
    return parsed[1] if parsed is not None else text


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-canary",
                                     description="KV-cache integrity canaries generated from kernels.yaml.")
    sub = parser.add_subparsers(metavar="COMMAND")
    add_codegen_commands(sub, Path.cwd(), installed_layout=installed_layout)
    # Listed for --help; its arguments belong to the demo's own parser (see main).
    p = sub.add_parser("demo", help="run the end-to-end demo (`kv-canary demo --help` for its options)",
                       add_help=False)
    p.set_defaults(func=lambda args: run_demo([]))
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        return run_demo(argv[1:])
    return run(build_parser(), argv)
