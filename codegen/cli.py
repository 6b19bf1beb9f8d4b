"""Command line: `python -m codegen {generate,check,describe,diff}`; `kv-canary` adds `demo` (kv_canary/cli.py)."""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .diagnostics import SchemaError, escape_text, internal_error
from .diff import diff_schemas, format_markdown
from .load import load_schema_bytes, read_schema
from .render import make_environment, render_all, render_body, template_context
from .sources import SourceUnavailable, read_source
from .writer import compare_tree, tree_lock, write_tree


def _display(path: Path) -> str:
    """A path as diagnostics show it: relative when under the current directory, else as given."""
    try:
        return Path(path).resolve().relative_to(Path.cwd().resolve()).as_posix()
    except ValueError:
        return str(path)


def _load(schema_path: Path):
    """(schema, the normalised text it was parsed from): the file is read once."""
    return read_schema(schema_path, display_name=_display(schema_path))


def _tell_waiting(lock: Path) -> None:
    print(f"waiting for another generator run on this tree to finish (lock {_display(lock)})", file=sys.stderr,
          flush=True)


def cmd_generate(args) -> int:
    start = time.perf_counter()
    schema, text = _load(args.schema)
    files = render_all(schema, text)
    written, removed = write_tree(args.out, files, on_wait=_tell_waiting)
    out = _display(args.out)
    for p in written:
        print(f"wrote {out}/{p}")
    for p in removed:
        print(f"removed {out}/{p}")
    print(f"{out}: {len(files)} files, {len(written)} written, {len(removed)} removed "
          f"in {time.perf_counter() - start:.2f}s")
    return 0


def regenerate_command(args) -> str:
    """The exact command that regenerates args.out from args.schema."""
    if args.schema.resolve() == (args.root / "kernels.yaml").resolve() and \
            args.out.resolve() == (args.root / "generated").resolve():
        return "make generate"
    return f"python -m codegen generate --schema {_display(args.schema)} --out {_display(args.out)}"


def cmd_check(args) -> int:
    schema, text = _load(args.schema)
    files = render_all(schema, text)
    regenerate = regenerate_command(args)
    if args.out.is_dir():  # not while a `generate` is half-way through writing it
        with tree_lock(args.out, shared=True, on_wait=_tell_waiting):
            drifts = compare_tree(args.out, files, _display(args.out), regenerate)
    else:
        drifts = compare_tree(args.out, files, _display(args.out), regenerate)
    if not drifts:
        print(f"{_display(args.out)} is up to date with {_display(args.schema)} ({len(files)} files)")
        return 0
    err = sys.stderr
    for i, d in enumerate(drifts):
        print(escape_text(f"{d.path}: {d.detail}"), file=err)  # a file name on disk can hold anything
        if i + 1 == len(drifts) or drifts[i + 1].fix != d.fix:  # one fix line per run of identical fixes
            print(f"    fix: {d.fix}", file=err)
    if not args.quiet:
        for d in drifts:
            if d.diff:
                err.write(d.diff if d.diff.endswith("\n") else d.diff + "\n")
    print(f"{len(drifts)} generated file(s) out of date with {_display(args.schema)}; "
          f"run `{regenerate}` and commit {_display(args.out)}/", file=err)
    return 1


def cmd_describe(args) -> int:
    if args.schema is None:
        args.schema = args.root / "kernels.yaml"
        if not args.schema.is_file() and args.installed_layout is not None:
            # Outside a checkout (an installed wheel): the layer the package was generated from.
            sys.stdout.write(args.installed_layout())
            return 0
    schema, _ = _load(args.schema)
    env = make_environment()
    sys.stdout.write(render_body(env, "docs/LAYOUT.md.j2", template_context(schema), "LAYOUT.md"))
    return 0


def cmd_diff(args) -> int:
    root = args.root
    try:
        old_name, old_raw = read_source(args.old, root)
    except SourceUnavailable as exc:
        if args.missing_base_ok and exc.no_base:
            print(f"kv-canary diff: nothing to compare: {exc}. Passing: there is no base schema to break.")
            return 0
        print(f"kv-canary diff: {exc}", file=sys.stderr)
        return 1
    try:
        new_name, new_raw = read_source(args.new, root)
    except SourceUnavailable as exc:
        print(f"kv-canary diff: {exc}", file=sys.stderr)
        return 1
    old = load_schema_bytes(old_raw, old_name)
    new = load_schema_bytes(new_raw, new_name)
    report = diff_schemas(old, new, old_name, new_name)
    sys.stdout.write(format_markdown(report))
    return report.exit_status


def add_codegen_commands(sub, root: Path, installed_layout=None) -> None:
    """The generator's subcommands, on paths relative to `root`. `installed_layout`, when given, is
    what `describe` prints without --schema where `root` has no kernels.yaml (kv_canary passes the
    installed default layer's LAYOUT.md)."""
    def common(p, schema_default=root / "kernels.yaml"):
        p.add_argument("--schema", type=Path, default=schema_default, help="schema file (kernels.yaml)")
        p.add_argument("--out", type=Path, default=root / "generated", help="generated tree")
    p = sub.add_parser("generate", help="render kernels.yaml into generated/")
    common(p)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("check", help="fail if generated/ differs from what kernels.yaml produces")
    common(p)
    p.add_argument("--quiet", action="store_true", help="no unified diffs")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("describe", help="print the layout tables")
    common(p, schema_default=None)
    p.set_defaults(installed_layout=installed_layout)
    p.set_defaults(func=cmd_describe)
    p = sub.add_parser("diff", help="semantic ABI diff of two schemas (files or git revisions)",
                       description="Compare two schemas and classify every change as compatible or BREAKING. "
                                   "Exit 2 when something breaks and abi_version was not bumped.")
    p.add_argument("old", help="old schema: a file, a git revision (HEAD~1 means HEAD~1:kernels.yaml) or REV:PATH")
    p.add_argument("new", nargs="?", default="kernels.yaml", help="new schema (default: kernels.yaml)")
    p.add_argument("--missing-base-ok", action="store_true",
                   help="pass with a note when there is no OLD to compare with: OLD is the parent of a first "
                        "commit, lies beyond a shallow clone's history, or has no schema file yet; a revision "
                        "that does not exist (a typo) still fails")
    p.set_defaults(func=cmd_diff)
    for p in sub.choices.values():
        p.set_defaults(root=root)


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
    except OSError as exc:  # e.g. an unwritable --out: a message, not a traceback
        print(escape_text(f"{parser.prog}: error: {exc.strerror or exc}: {exc.filename or ''}".rstrip(": ")),
              file=sys.stderr)
        return 1
    except Exception as exc:  # the last resort: a bug of the generator is reported as one, not as a traceback
        schema = getattr(args, "schema", None)
        print(internal_error(_display(schema) if schema is not None else parser.prog, exc), file=sys.stderr)
        print("1 error", file=sys.stderr)
        return 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__)
    sub = parser.add_subparsers(metavar="COMMAND")
    add_codegen_commands(sub, Path.cwd())
    return run(parser, argv)
