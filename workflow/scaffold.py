"""`kv-canary init`: set up an engine's repository for kv-canary.

Writes the schema (a copy of the default or of an example), `kv-canary.yaml` (the schema/output
pairs every command, hook and the action read), the generated package inside the engine's package,
and the pre-commit and GitHub workflow files (or, where those files exist, prints what to add).
Nothing that exists is overwritten unless --force.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from ..codegen.project import CONFIG_NAME
from ..codegen.writer import LOCK_NAME

# Where engines take the hooks and the action from (`repo:` / `uses:`).
REPOSITORY = "kv-canary/kv-canary"
REPOSITORY_URL = f"https://github.com/{REPOSITORY}"
WORKFLOW_PATH = ".github/workflows/kv-canary.yml"
PRECOMMIT_PATH = ".pre-commit-config.yaml"
GITIGNORE_PATH = ".gitignore"
# How to check that the pinned revision exists (a tag that was never pushed fails every CI run).
REV_CHECK = f"git ls-remote {REPOSITORY_URL} <rev>"


@dataclass(frozen=True)
class Scaffold:
    schema: str      # e.g. canary.yaml (relative to the repository root)
    package: str     # e.g. myengine/_canary
    rev: str         # the kv-canary tag or commit the hooks and the action pin, e.g. v0.1.0


def schema_text(source_text: str, s: Scaffold) -> str:
    """The source schema without its leading comment block, under a header written for the engine."""
    lines = source_text.splitlines(keepends=True)
    while lines and (lines[0].startswith("#") or not lines[0].strip()):
        lines.pop(0)
    head = (f"# kv-canary schema: the canary record layout, violation ring, fail reasons, constants and\n"
            f"# kernels of this engine's KV-cache canary (format: {REPOSITORY_URL}/blob/{s.rev}/docs/schema.md).\n"
            f"# After editing run `kv-canary generate` (it rewrites {s.package}/); a breaking change needs\n"
            f"# abi_version bumped (`kv-canary abi-check`, the pre-commit hook and the CI action check it).\n")
    return head + "".join(lines)


def config_text(s: Scaffold) -> str:
    return (f"# kv-canary: the schemas of this repository and their generated packages. `kv-canary generate`,\n"
            f"# `kv-canary check`, `kv-canary abi-check`, the pre-commit hooks and the CI action read it.\n"
            f"# Paths are relative to this file; add one entry per schema.\n"
            f"kv-canary: 1\n"
            f"trees:\n"
            f"  - schema: {s.schema}\n"
            f"    out: {s.package}\n")


def precommit_snippet(s: Scaffold) -> str:
    return (f"  # kv-canary: the generated package is up to date; a breaking schema change bumps abi_version.\n"
            f"  # `rev` must be a tag or commit of kv-canary that exists (`{REV_CHECK}` prints it;\n"
            f"  # where no release tag is published, pin a commit sha: `kv-canary init --rev SHA`), the one whose\n"
            f"  # generator made this repository's tree.\n"
            f"  - repo: {REPOSITORY_URL}\n"
            f"    rev: {s.rev}\n"
            f"    hooks:\n"
            f"      - id: kv-canary-check\n"
            f"      - id: kv-canary-abi\n")


def precommit_config(s: Scaffold) -> str:
    return "repos:\n" + precommit_snippet(s)


def workflow_text(s: Scaffold) -> str:
    return f"""\
# kv-canary: on every pull request, check the generated package and put the ABI report (the table of
# schema changes and the LAYOUT.md diff) on the job summary and in a comment; fail on a breaking
# change without an abi_version bump.
name: kv-canary
on:
  pull_request:
permissions:
  contents: read
  pull-requests: write
jobs:
  abi:
    runs-on: ubuntu-latest
    steps:
      - uses: actions/checkout@v4
        with:
          fetch-depth: 0  # the base branch's history: the report diffs against the merge base
      # The revision must be a tag or commit of kv-canary that exists (`{REV_CHECK}` prints it;
      # where no release tag is published, pin a commit sha: `kv-canary init --rev SHA`).
      - id: kv-canary
        uses: {REPOSITORY}@{s.rev}
      - name: Comment the ABI report on the pull request
        if: ${{{{ always() && steps.kv-canary.outputs.report != '' }}}}
        continue-on-error: true  # a pull request from a fork gets a read-only token
        env:
          GH_TOKEN: ${{{{ github.token }}}}
          PR: ${{{{ github.event.pull_request.number }}}}
          REPORT: ${{{{ steps.kv-canary.outputs.report }}}}
        run: gh pr comment "$PR" --edit-last --body-file "$REPORT" || gh pr comment "$PR" --body-file "$REPORT"
"""


def default_package(root: Path) -> str | None:
    """`<pkg>/_canary` when the repository has exactly one top-level Python package (or one under src/)."""
    found = [p for base in (root, root / "src") if base.is_dir() for p in sorted(base.iterdir())
             if p.is_dir() and (p / "__init__.py").is_file() and not p.name.startswith((".", "_", "test"))]
    if len(found) == 1:
        return (found[0].relative_to(root) / "_canary").as_posix()
    return None


_PACKAGE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(/[A-Za-z_][A-Za-z0-9_]*)*")


def check_package(package: str) -> str | None:
    """Why `package` cannot hold the generated package (None when it can)."""
    if not _PACKAGE.fullmatch(package):
        return (f"--package must be a path of Python identifiers separated by '/', such as myengine/_canary, "
                f"got {package!r}")
    return None


def gitignore_entry(s: Scaffold) -> str:
    """The .gitignore line for the generator's lock file in the generated package (never committed)."""
    return f"/{s.package}/{LOCK_NAME}"


def gitignore_text(existing: str, s: Scaffold) -> str | None:
    """`existing` .gitignore text with the lock file's entry added (None: it is there already)."""
    entry = gitignore_entry(s)
    if entry in existing.splitlines():
        return None
    head = existing if not existing or existing.endswith("\n") else existing + "\n"
    return head + "# kv-canary: the generator's lock file (kv-canary generate takes it while it writes)\n" + entry + "\n"


def plan(root: Path, s: Scaffold, source_text: str) -> list[tuple[Path, str, bool]]:
    """(path, text, required) of each file init writes; a required file that exists stops init
    (unless --force), an optional one (pre-commit config, workflow) is left alone and its snippet printed."""
    return [
        (root / s.schema, schema_text(source_text, s), True),
        (root / CONFIG_NAME, config_text(s), True),
        (root / PRECOMMIT_PATH, precommit_config(s), False),
        (root / WORKFLOW_PATH, workflow_text(s), False),
    ]
