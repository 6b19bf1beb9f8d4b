"""The `kv-canary` command (also `python -m kv_canary`): the codegen subcommands plus `init` and `demo`."""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

from .codegen.cli import add_codegen_commands, run


def installed_layout() -> str:
    """LAYOUT.md of the default generated layer (what `describe` renders), for use outside a checkout."""
    from .codegen.render import split_header
    from .layer.loader import default_generated_dir

    text = (default_generated_dir() / "LAYOUT.md").read_text(encoding="utf-8")
    parsed = split_header(text)
    return parsed[1] if parsed is not None else text


def _schema_sources() -> dict[str, Path]:
    """What `init --from` can start from: the default schema and the shipped examples."""
    here = Path(__file__).resolve().parent
    return {"default": here / "default_schema.yaml", **{p.stem: p for p in sorted((here / "schemas").glob("*.yaml"))}}


def _version() -> str:
    from .codegen.version import kv_canary_version
    return kv_canary_version()


def cmd_init(args) -> int:
    from .codegen import scaffold
    from .codegen.cli import cmd_generate
    from .codegen.project import CONFIG_NAME

    root = Path.cwd()
    package = args.package or scaffold.default_package(root)
    if package is None:
        print("kv-canary init: error: --package is required here (no single top-level Python package to put "
              "the generated package in); e.g. --package myengine/_canary", file=sys.stderr)
        return 2
    problem = scaffold.check_package(package)
    if problem:
        print(f"kv-canary init: error: {problem}", file=sys.stderr)
        return 2
    s = scaffold.Scaffold(schema=args.schema, package=package, rev=args.rev or f"v{_version()}")
    files = scaffold.plan(root, s, _schema_sources()[args.source].read_text(encoding="utf-8"))
    clash = [p for p, _, required in files if required and p.exists()]
    if clash and not args.force:
        for p in clash:
            print(f"kv-canary init: error: {p.relative_to(root).as_posix()} exists (--force overwrites it)",
                  file=sys.stderr)
        return 1
    for path, text, required in files:
        shown = path.relative_to(root).as_posix()
        if not required and path.exists() and not args.force:
            if path.name == scaffold.PRECOMMIT_PATH:
                print(f"{shown} exists; add this to it:\n{scaffold.precommit_snippet(s)}")
            else:
                print(f"{shown} exists and is left as it is; kv-canary's workflow (for another file in "
                      f"{path.parent.relative_to(root).as_posix()}/):\n{text}")
            continue
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {shown}")
    ignore = root / scaffold.GITIGNORE_PATH
    text = scaffold.gitignore_text(ignore.read_text(encoding="utf-8") if ignore.is_file() else "", s)
    if text is not None:
        ignore.write_text(text, encoding="utf-8")
        print(f"added {scaffold.gitignore_entry(s)} to {scaffold.GITIGNORE_PATH}")
    parent = (root / package).parent
    if parent != root and not (parent / "__init__.py").exists():
        print(f"note: {parent.relative_to(root).as_posix()}/ has no __init__.py; the generated package is "
              f"imported as {package.replace('/', '.')} once it has one")
    args.schema, args.out, args.tree, args.config = None, None, None, None
    status = cmd_generate(args)
    print(f"next: import {package.replace('/', '.')} in your engine, commit {s.schema}, {CONFIG_NAME}, "
          f"{s.package}/, .gitignore, .pre-commit-config.yaml and .github/workflows/kv-canary.yml, and run "
          f"`pre-commit install`; they pin kv-canary {s.rev}: check it exists with `{scaffold.REV_CHECK.replace('<rev>', s.rev)}` "
          f"(else `kv-canary init --force --rev SHA`)")
    return status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kv-canary",
                                     description="KV-cache integrity canaries generated from kernels.yaml.")
    from .codegen.version import add_version_option
    add_version_option(parser)
    sub = parser.add_subparsers(metavar="COMMAND")
    add_codegen_commands(sub, Path.cwd(), installed_layout=installed_layout)
    p = sub.add_parser("init", help="set up an engine repository: schema, kv-canary.yaml, generated package, "
                                    "pre-commit hooks and the CI workflow")
    p.add_argument("--from", dest="source", choices=tuple(_schema_sources()), default="default",
                   help="the schema to start from (default: SGLang's layout; the others are kv-canary's examples)")
    p.add_argument("--schema", default="canary.yaml", help="the schema file to write (default: canary.yaml)")
    p.add_argument("--package", default=None,
                   help="where the generated package goes, e.g. myengine/_canary (imported as myengine._canary; "
                        "default: <your one top-level package>/_canary)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument("--rev", default=None, metavar="REV",
                   help="the kv-canary tag or commit the pre-commit hooks and the workflow pin (default: "
                        "v<this version>; a commit sha where no release tag is published)")
    p.set_defaults(func=cmd_init)
    # Listed for --help only: main hands `demo` and its arguments to the demo's own parser.
    sub.add_parser("demo", help="run the end-to-end demo (`kv-canary demo --help` for its options)", add_help=False)
    return parser


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo"]:
        from . import demo  # imported lazily: the codegen subcommands must not pay for torch
        return demo.main(argv[1:])
    return run(build_parser(), argv)
