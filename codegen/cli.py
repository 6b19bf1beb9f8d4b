"""Command line: `python -m codegen {generate,check,describe}` (also the `kv-canary` script)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from .diagnostics import SchemaError
from .load import load_schema
from .render import make_environment, render_all, render_body, template_context
from .writer import compare_tree, write_tree

FIX_HINT = "fix: run `make generate` (or `python -m codegen generate`) and commit generated/"


def _display(path: Path) -> str:
    try:
        return os.path.relpath(path)
    except ValueError:
        return str(path)


def _load(schema_path: Path):
    schema = load_schema(schema_path, display_name=_display(schema_path))
    text = schema_path.read_bytes().decode("utf-8")
    return schema, text


def cmd_generate(args) -> int:
    start = time.perf_counter()
    schema, text = _load(args.schema)
    files = render_all(schema, text)
    written, removed = write_tree(args.out, files)
    out = _display(args.out)
    for p in written:
        print(f"wrote {out}/{p}")
    for p in removed:
        print(f"removed {out}/{p}")
    print(f"{out}: {len(files)} files, {len(written)} written, {len(removed)} removed "
          f"in {time.perf_counter() - start:.2f}s")
    return 0


def cmd_check(args) -> int:
    schema, text = _load(args.schema)
    files = render_all(schema, text)
    drifts = compare_tree(args.out, files, _display(args.out))
    if not drifts:
        print(f"{_display(args.out)} is up to date with {_display(args.schema)} ({len(files)} files)")
        return 0
    for d in drifts:
        print(f"{d.path}: {d.detail}", file=sys.stderr)
    if not args.quiet:
        for d in drifts:
            if d.diff:
                sys.stderr.write(d.diff if d.diff.endswith("\n") else d.diff + "\n")
    print(f"{len(drifts)} generated file(s) out of date. {FIX_HINT}", file=sys.stderr)
    return 1


def cmd_describe(args) -> int:
    schema, _ = _load(args.schema)
    env = make_environment()
    sys.stdout.write(render_body(env, "docs/LAYOUT.md.j2", template_context(schema), "LAYOUT.md"))
    return 0


def add_codegen_commands(sub, root: Path) -> None:
    def common(p):
        p.add_argument("--schema", type=Path, default=root / "kernels.yaml", help="schema file (kernels.yaml)")
        p.add_argument("--out", type=Path, default=root / "generated", help="generated tree")
    p = sub.add_parser("generate", help="render kernels.yaml into generated/")
    common(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("check", help="fail if generated/ differs from what kernels.yaml produces")
    common(p)
    p.add_argument("--quiet", action="store_true", help="no unified diffs")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("describe", help="print the layout tables")
    common(p)
    p.set_defaults(func=cmd_describe)


def run(parser: argparse.ArgumentParser, argv=None) -> int:
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return args.func(args)
    except SchemaError as exc:
        print(exc, file=sys.stderr)
        n = len(exc.diagnostics)
        print(f"{n} error{'s' if n != 1 else ''}", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    sub = parser.add_subparsers(metavar="COMMAND")
    add_codegen_commands(sub, Path.cwd())
    return run(parser, argv)
