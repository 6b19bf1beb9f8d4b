"""The workflow's commands, beside the generator's (codegen/cli.py): `abi-check` (the pre-commit
hook), `pr-report` (the GitHub Action) and `init` (an engine repository's set-up). `kv-canary`
(kv_canary/cli.py) adds them after the generator's; they share its tree options and its `run`.
"""
from __future__ import annotations

import sys
from pathlib import Path

from ..codegen.cli import cmd_generate, tree_options, trees_of
from ..codegen.project import CONFIG_NAME
from ..codegen.version import kv_canary_version
from . import scaffold
from .report import abi_check, pr_report


def cmd_abi_check(args) -> int:
    return abi_check(trees_of(args), args.base, args.format)


def cmd_pr_report(args) -> int:
    return pr_report(trees_of(args), base=args.base, summary=args.summary, comment=args.comment,
                     output=args.github_output, fmt=args.format)


def cmd_init(args) -> int:
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
    s = scaffold.Scaffold(schema=args.schema, package=package, rev=args.rev or f"v{kv_canary_version()}")
    files = scaffold.plan(root, s, args.schema_sources[args.source].read_text(encoding="utf-8"))
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


def add_workflow_commands(sub, root: Path, schema_sources: dict[str, Path]) -> None:
    """abi-check, pr-report and init, on paths relative to `root`; `schema_sources` is what `init --from`
    can start from (name -> schema file: kv-canary's default schema and its examples)."""
    p = sub.add_parser("abi-check", help="diff every schema against a base revision; exit 2 on a breaking change "
                                         "without an abi_version bump (the pre-commit hook)")
    tree_options(p, root)
    p.add_argument("--base", default=None,
                   help="base git revision (default: the merge base of HEAD with the default branch)")
    p.add_argument("--format", choices=("text", "markdown", "json"), default="text",
                   help="text or markdown: per schema; json: one object for every schema (versioned: "
                        "workflow/report.schema.json)")
    p.set_defaults(func=cmd_abi_check)
    p = sub.add_parser("pr-report", help="the CI action: check the trees, diff against the pull request's base, "
                                         "write the ABI report to the job summary and a comment file")
    tree_options(p, root)
    p.add_argument("--base", default=None, help="base revision (default: merge base with origin/$GITHUB_BASE_REF, "
                                                "else with the default branch)")
    p.add_argument("--summary", type=Path, default=None, help="append the report here (default: $GITHUB_STEP_SUMMARY)")
    p.add_argument("--comment", type=Path, default=None,
                   help="write the report here for a comment step (default: $RUNNER_TEMP/kv-canary-report.md)")
    p.add_argument("--github-output", type=Path, default=None, help="step outputs file (default: $GITHUB_OUTPUT)")
    p.add_argument("--format", choices=("markdown", "json"), default="markdown",
                   help="what stdout gets: the Markdown report, or one JSON object (workflow/report.schema.json); "
                        "the summary and comment files are Markdown either way")
    p.set_defaults(func=cmd_pr_report)
    p = sub.add_parser("init", help="set up an engine repository: schema, kv-canary.yaml, generated package, "
                                    "pre-commit hooks and the CI workflow")
    p.add_argument("--from", dest="source", choices=tuple(schema_sources), default="default",
                   help="the schema to start from (default: SGLang's layout; the others are kv-canary's examples)")
    p.add_argument("--schema", default="canary.yaml", help="the schema file to write (default: canary.yaml)")
    p.add_argument("--package", default=None,
                   help="where the generated package goes, e.g. myengine/_canary (imported as myengine._canary; "
                        "default: <your one top-level package>/_canary)")
    p.add_argument("--force", action="store_true", help="overwrite existing files")
    p.add_argument("--rev", default=None, metavar="REV",
                   help="the kv-canary tag or commit the pre-commit hooks and the workflow pin (default: "
                        "v<this version>; a commit sha where no release tag is published)")
    p.set_defaults(func=cmd_init, schema_sources=schema_sources)
    for name in ("abi-check", "pr-report", "init"):
        sub.choices[name].set_defaults(root=root)
