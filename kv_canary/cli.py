"""The `kv-canary` command (also `python -m kv_canary`): the generator's subcommands (codegen/cli.py), the
workflow's (`abi-check`, `pr-report`, `init`: workflow/cli.py) and `demo`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .codegen.cli import add_codegen_commands, run
from .workflow.cli import add_workflow_commands


def installed_layout() -> str:
    """LAYOUT.md of the default generated tree (what `describe` renders), for use outside a checkout."""
    from .codegen.render import split_header
    from .trees.loader import default_generated_dir

    text = (default_generated_dir() / "LAYOUT.md").read_text(encoding="utf-8")
    parsed = split_header(text)
    return parsed[1] if parsed is not None else text


def _schema_sources() -> dict[str, Path]:
    """What `init --from` can start from: the default schema and the shipped examples."""
    here = Path(__file__).resolve().parent
    return {"default": here / "default_schema.yaml", **{p.stem: p for p in sorted((here / "schemas").glob("*.yaml"))}}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-canary",
                                     description="KV-cache integrity canaries generated from kernels.yaml.")
    from .codegen.version import add_version_option
    add_version_option(parser)
    sub = parser.add_subparsers(metavar="COMMAND")
    add_codegen_commands(sub, Path.cwd(), installed_layout=installed_layout)
    add_workflow_commands(sub, Path.cwd(), _schema_sources())
    # Listed for --help only: main hands `demo` and its arguments to the demo's own parser.
    sub.add_parser("demo", help="run the end-to-end demo (`kv-canary demo --help` for its options)", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from . import demo  # imported lazily: the codegen subcommands must not pay for torch
        return demo.main(argv[1:])
    return run(build_parser(), argv)
