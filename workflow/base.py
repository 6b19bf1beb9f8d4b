"""The base revision a schema change is judged against: the merge base of HEAD with the pull
request's target (GITHUB_BASE_REF), with kv-canary.yaml's base_branch, or with the default branch;
or a revision given as --base. The generator reads a schema at a revision it is given
(codegen/sources.py, `diff OLD NEW`); choosing the revision a change is judged against is the workflow's.
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

from ..codegen.project import Tree


class BaseError(Exception):
    """No base revision to compare with, and that is an error (not 'nothing to compare')."""


def git(cwd: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def default_base(cwd: Path, branch: str | None = None) -> tuple[str | None, str]:
    """(revision, how it was chosen) the ABI check compares with by default: the merge base of HEAD
    with the default branch (`branch`, else origin's HEAD, else origin/main, origin/master, main,
    master, the first that exists). (None, why) when there is none."""
    candidates = [branch] if branch else []
    head = git(cwd, "symbolic-ref", "-q", "--short", "refs/remotes/origin/HEAD")
    if head.returncode == 0 and head.stdout.strip():
        candidates.append(head.stdout.strip())
    candidates += ["origin/main", "origin/master", "main", "master"]
    for name in dict.fromkeys(candidates):
        if git(cwd, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}").returncode != 0:
            continue
        mb = git(cwd, "merge-base", "HEAD", name)
        if mb.returncode == 0 and mb.stdout.strip():
            return mb.stdout.strip(), f"the merge base of HEAD with {name}"
        return None, f"HEAD has no common history with {name}"
    return None, "no default branch found (tried " + ", ".join(dict.fromkeys(candidates)) + ")"


def not_a_repository(cwd: Path) -> str:
    """Why `cwd` has no git history to compare with ('' when it is inside a git work tree)."""
    try:
        inside = git(cwd, "rev-parse", "--is-inside-work-tree")
    except FileNotFoundError:
        return "git is not installed"
    if inside.returncode != 0 or inside.stdout.strip() != "true":
        return f"{cwd} is not inside a git repository"
    return ""


def resolve_base(base: str | None, trees: list[Tree]) -> tuple[str | None, str]:
    """(revision, how it was chosen); (None, why) when there is no base at all (not a git repository,
    a repository without a default branch). A named base that does not exist raises BaseError."""
    cwd = Path.cwd()
    outside = not_a_repository(cwd)
    if outside:
        if base:
            raise BaseError(f"--base {base}: {outside}, so there is no revision to compare with")
        return None, f"{outside} (run it in the engine's git checkout, or compare two files with `kv-canary diff OLD NEW`)"
    if base:
        return base, "given as --base"
    ref = os.environ.get("GITHUB_BASE_REF")
    if ref:  # a pull_request run: merge base with the target branch, fetched by actions/checkout
        for name in (f"origin/{ref}", ref):
            if git(cwd, "rev-parse", "--verify", "--quiet", f"{name}^{{commit}}").returncode == 0:
                mb = git(cwd, "merge-base", "HEAD", name)
                if mb.returncode == 0:
                    return mb.stdout.strip(), f"the merge base of HEAD with {name}"
                raise BaseError(f"HEAD and {name} have no common history in this clone (actions/checkout with "
                                f"`fetch-depth: 0` fetches it)")
        raise BaseError(f"the pull request's base branch {ref} is not in this clone (actions/checkout with "
                        f"`fetch-depth: 0` fetches it)")
    branch = next((t.base_branch for t in trees if t.base_branch), None)
    return default_base(cwd, branch)
