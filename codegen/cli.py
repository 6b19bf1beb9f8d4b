"""Command line of the generator: `python -m codegen {generate,check,describe,diff}`. `kv-canary` adds
the workflow's commands `abi-check`, `pr-report` and `init` (workflow/cli.py) and `demo` (kv_canary/cli.py).

Exit codes (docs/schema-change.md): 0 success; 1 a stale or hand-edited generated tree, a schema or
config error, an unreadable base revision; 2 a breaking schema change without an abi_version bump
(diff, abi-check, pr-report) or a command line error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from .diagnostics import SchemaError, escape_text, internal_error
from .diff import FORMATS, FixHint, diff_schemas
from .load import load_schema_bytes
from .project import CONFIG_NAME, Tree, nesting, resolve_trees, unusable_out
from .render import make_environment, render_all, render_body, template_context
from .sources import SourceUnavailable, read_source
from .trees import _display, _load, _tell_waiting, check_tree, fix_hint, provenance
from .version import add_version_option, kv_canary_version
from .writer import write_tree

CHECK_JSON_FORMAT = "kv-canary-check"
CHECK_JSON_VERSION = 2   # 2: kv_canary_version added


class UsageError(Exception):
    """Paths no command can work on, said as `PROG: error: ...`: exit 1 for a path that cannot be used
    (as for an unwritable --out), 2 for a command line whose paths contradict each other."""

    def __init__(self, message: str, status: int = 1):
        super().__init__(message)
        self.status = status


def _parse_tree(value: str) -> tuple[Path, Path]:
    schema, sep, out = value.partition("=")
    if not sep or not schema or not out:
        raise argparse.ArgumentTypeError(f"expected SCHEMA=OUT (e.g. canary.yaml=myengine/_canary), got {value!r}")
    return Path(schema), Path(out)


def trees_of(args, *, goldens: bool = False) -> list[Tree]:
    """The trees a command works on: --tree pairs, else --schema/--out, else kv-canary.yaml, else the
    default; with `goldens` (generate, check) the default in kv-canary's checkout brings the example
    schemas' golden trees along."""
    cwd = Path.cwd()
    config = getattr(args, "config", None)
    pairs = getattr(args, "tree", None) or [(args.schema, args.out)]
    trees = []
    for schema, out in pairs:
        trees += resolve_trees(schema, out, cwd, config)
    if goldens and pairs == [(None, None)] and len(trees) == 1:
        trees += trees[0].goldens()
    trees = list({t.out: t for t in trees}.values())
    for t in trees:   # kv-canary.yaml's outs were checked where they are listed (load_config)
        problem = None if t.configured else unusable_out(t.out)
        if problem:
            raise UsageError(f"{_display(t.out)} cannot hold a generated tree: {problem}")
    outs = [t.out for t in trees]
    for out in outs:   # kv-canary.yaml's own trees were checked where they are listed (load_config)
        outer = nesting(out, outs)
        if outer is not None:
            raise UsageError(f"the generated tree {_display(out)} lies inside the generated tree {_display(outer)}: "
                             f"a generated tree holds only what kv-canary generates, so another tree cannot live in "
                             f"it; give each tree its own folder", status=2)
    return trees


def cmd_generate(args) -> int:
    for tree in trees_of(args, goldens=True):
        start = time.perf_counter()
        args.schema = tree.schema  # what an internal error is reported against
        schema, text = _load(tree.schema, tree)
        files = render_all(schema, text, provenance=provenance(tree))
        written, removed = write_tree(tree.out, files, on_wait=_tell_waiting)
        out = _display(tree.out)
        for p in written:
            print(f"wrote {out}/{p}")
        for p in removed:
            print(f"removed {out}/{p}")
        print(f"{out}: {len(files)} files, {len(written)} written, {len(removed)} removed "
              f"in {time.perf_counter() - start:.2f}s")
    return 0


def cmd_check(args) -> int:
    results = []
    for tree in trees_of(args, goldens=True):
        args.schema = tree.schema
        results.append((tree, *check_tree(tree)))
    if args.format == "json":
        sys.stdout.write(json.dumps(check_json(results), indent=2, ensure_ascii=False) + "\n")
        return 1 if any(drifts for _, _, drifts in results) else 0
    status = 0
    for tree, n_files, drifts in results:
        status |= _print_check(tree, n_files, drifts, args.quiet)
    return status


def check_json(results) -> dict:
    """The versioned JSON shape of `check --format json` (codegen/check.schema.json)."""
    trees = []
    for tree, n_files, drifts in results:
        trees.append({"schema": _display(tree.schema), "out": _display(tree.out), "files": n_files,
                      "up_to_date": not drifts, "regenerate": tree.regenerate(Path.cwd()),
                      "drifts": [{"path": d.path, "kind": d.kind, "detail": d.detail, "fix": d.fix} for d in drifts]})
    return {"format": CHECK_JSON_FORMAT, "version": CHECK_JSON_VERSION, "kv_canary_version": kv_canary_version(),
            "up_to_date": all(t["up_to_date"] for t in trees),
            "exit_status": 0 if all(t["up_to_date"] for t in trees) else 1, "trees": trees}


def _print_check(tree: Tree, n_files: int, drifts, quiet: bool) -> int:
    if not drifts:
        print(f"{_display(tree.out)} is up to date with {_display(tree.schema)} ({n_files} files)")
        return 0
    err = sys.stderr
    for i, d in enumerate(drifts):
        print(escape_text(f"{d.path}: {d.detail}"), file=err)  # a file name on disk can hold anything
        if i + 1 == len(drifts) or drifts[i + 1].fix != d.fix:  # one fix line per run of identical fixes
            print(f"    fix: {d.fix}", file=err)
    if not quiet:
        for d in drifts:
            if d.diff:
                err.write(d.diff if d.diff.endswith("\n") else d.diff + "\n")
    print(f"{len(drifts)} generated file(s) out of date with {_display(tree.schema)}; "
          f"run `{tree.regenerate(Path.cwd())}` and commit {_display(tree.out)}/", file=err)
    return 1


def cmd_describe(args) -> int:
    if args.schema is None:
        configured = [t for t in resolve_trees(None, None, Path.cwd()) if t.configured]
        args.schema = configured[0].schema if configured else args.root / "kernels.yaml"
        if len(configured) > 1:
            print(f"kv-canary describe: {CONFIG_NAME} lists {len(configured)} schemas; describing the first, "
                  f"{_display(args.schema)} (--schema FILE names another)", file=sys.stderr)
        # Only where there is no schema file at all: one that cannot be read (a link that dangles or
        # loops) is an error naming it, not a silent switch to another layout.
        if not os.path.lexists(args.schema) and args.installed_layout is not None:
            # Outside a checkout (an installed wheel): the tree the package was generated from.
            print(f"kv-canary describe: no {CONFIG_NAME} and no kernels.yaml here: describing kv-canary's built-in "
                  f"schema (the default layout it was installed with); --schema FILE describes yours",
                  file=sys.stderr)
            sys.stdout.write(args.installed_layout())
            return 0
    schema, _ = _load(args.schema)
    env = make_environment()
    sys.stdout.write(render_body(env, "docs/LAYOUT.md.j2", template_context(schema), "LAYOUT.md"))
    return 0


def cmd_diff(args) -> int:
    root = args.root
    new_spec = args.new
    if new_spec is None:  # the configured schema when there is exactly one, else kernels.yaml
        trees = resolve_trees(None, None, Path.cwd(), args.config)
        new_spec = _display(trees[0].schema) if len(trees) == 1 else "kernels.yaml"
    try:
        default_path = new_spec if (root / new_spec).is_file() else new_spec.partition(":")[2] or "kernels.yaml"
        old_name, old_raw = read_source(args.old, root, default_path=default_path)
    except SourceUnavailable as exc:
        if args.missing_base_ok and exc.no_base:
            print(f"kv-canary diff: nothing to compare: {exc}. Passing: there is no base schema to break.")
            return 0
        print(f"kv-canary diff: {exc}", file=sys.stderr)
        return 1
    try:
        new_name, new_raw = read_source(new_spec, root)
    except SourceUnavailable as exc:
        print(f"kv-canary diff: {exc}", file=sys.stderr)
        return 1
    old = load_schema_bytes(old_raw, old_name)
    new = load_schema_bytes(new_raw, new_name)
    report = diff_schemas(old, new, old_name, new_name)
    tree = next(iter(resolve_trees(Path(new_spec), None, Path.cwd(), args.config)), None) \
        if (root / new_spec).is_file() else None
    hint = fix_hint(tree) if tree is not None else FixHint(schema=new_name)
    sys.stdout.write(FORMATS[args.format](report, hint))
    return report.exit_status


def tree_options(p, root: Path, schema_default=None) -> None:
    p.add_argument("--schema", type=Path, default=schema_default,
                   help="schema file (default: every tree of kv-canary.yaml, else kernels.yaml)")
    p.add_argument("--out", type=Path, default=None,
                   help="generated tree (default: the schema's tree in kv-canary.yaml, else generated/)")
    p.add_argument("--tree", type=_parse_tree, action="append", metavar="SCHEMA=OUT",
                   help="a schema and its generated tree; repeat for several (instead of --schema/--out)")
    p.add_argument("--config", type=Path, default=None,
                   help="the kv-canary.yaml to read (default: the nearest one up to the git top level)")


def add_codegen_commands(sub, root: Path, installed_layout=None) -> None:
    """The generator's subcommands, on paths relative to `root`. `installed_layout`, when given, is
    what `describe` prints without --schema where `root` has no kernels.yaml (kv_canary passes the
    installed default tree's LAYOUT.md)."""
    p = sub.add_parser("generate", help="render the schema into its generated tree (kv-canary.yaml's trees, "
                                        "or kernels.yaml into generated/)")
    tree_options(p, root)
    p.set_defaults(func=cmd_generate)
    p = sub.add_parser("check", help="fail (exit 1) if a generated tree differs from what its schema produces")
    tree_options(p, root)
    p.add_argument("--quiet", action="store_true", help="no unified diffs")
    p.add_argument("--format", choices=("text", "json"), default="text",
                   help="json: one object on stdout (docs/schema-change.md, 'Machine-readable output')")
    p.set_defaults(func=cmd_check)
    p = sub.add_parser("describe", help="print the layout tables")
    p.add_argument("--schema", type=Path, default=None, help="schema file (kernels.yaml)")
    p.add_argument("--out", type=Path, default=root / "generated", help=argparse.SUPPRESS)
    p.set_defaults(installed_layout=installed_layout)
    p.set_defaults(func=cmd_describe)
    p = sub.add_parser("diff", help="semantic ABI diff of two schemas (files or git revisions)",
                       description="Compare two schemas and classify every change as compatible or BREAKING. "
                                   "Exit 2 when something breaks and abi_version was not bumped.")
    p.add_argument("old", help="old schema: a file, a git revision (HEAD~1 means HEAD~1:<the new schema's path>) "
                               "or REV:PATH")
    p.add_argument("new", nargs="?", default=None,
                   help="new schema (default: the one schema of kv-canary.yaml, else kernels.yaml)")
    p.add_argument("--format", choices=tuple(FORMATS), default="markdown",
                   help="markdown (a PR comment), text, or json (versioned: codegen/diff.schema.json)")
    p.add_argument("--config", type=Path, default=None, help=argparse.SUPPRESS)
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
    except UsageError as exc:
        print(escape_text(f"{parser.prog}: error: {exc}"), file=sys.stderr)
        return exc.status
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
    parser = argparse.ArgumentParser(prog="python -m codegen", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_version_option(parser, "python -m codegen (kv-canary)")
    sub = parser.add_subparsers(metavar="COMMAND")
    add_codegen_commands(sub, Path.cwd())
    return run(parser, argv)
