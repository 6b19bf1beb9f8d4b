"""Where `diff` reads a schema from: a file, or a git revision (`HEAD~1`, `main:kernels.yaml`)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

from .diagnostics import describe_unreadable

DEFAULT_SCHEMA = "kernels.yaml"

# REV~N, REV^, REV^2~3...: a revision reached by walking back from another one.
_ANCESTRY = re.compile(r"(.+?)((?:[~^]\d*)+)")
_COMMIT_ID = re.compile(r"[0-9a-fA-F]{4,40}")


class SourceUnavailable(Exception):
    """The named schema cannot be read.

    `no_base` is True only where there is legitimately nothing to compare with: the revision lies
    before the history of this clone (the parent of a first commit, or beyond a shallow clone's
    cut), or the schema file did not exist yet at that revision. A revision name that does not
    resolve in a full clone (a typo) is never `no_base`.
    """

    def __init__(self, message: str, *, no_base: bool = False) -> None:
        super().__init__(message)
        self.no_base = no_base


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceUnavailable(f"cannot run git: {exc}") from None


def _is_commit(root: Path, rev: str) -> bool:
    return _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode == 0


def _missing_revision(root: Path, rev: str) -> SourceUnavailable:
    """Why `rev` does not resolve, and whether that means there is no base (see SourceUnavailable)."""
    shallow = _git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
    walk = _ANCESTRY.fullmatch(rev)
    if walk and walk.group(1) == "HEAD" and not _is_commit(root, "HEAD"):
        return SourceUnavailable(f"git revision '{rev}' does not exist: the repository has no commit yet",
                                 no_base=True)
    if walk and _is_commit(root, walk.group(1)):
        start = walk.group(1)
        if shallow:
            return SourceUnavailable(f"git revision '{rev}' is not available: this is a shallow clone whose "
                                     f"history ends before it (`git fetch --unshallow` fetches the rest)",
                                     no_base=True)
        if not _is_commit(root, f"{start}^"):
            return SourceUnavailable(f"git revision '{rev}' does not exist: {start} is the first commit "
                                     f"(it has no parent)", no_base=True)
        return SourceUnavailable(f"git revision '{rev}' does not exist: the history of {start} is shorter "
                                 f"than that")
    if shallow and _COMMIT_ID.fullmatch(rev):
        return SourceUnavailable(f"git revision '{rev}' is not available: this is a shallow clone and the "
                                 f"commit is not in its history (`git fetch --unshallow` fetches the rest)",
                                 no_base=True)
    return SourceUnavailable(f"git revision '{rev}' does not exist: no such branch, tag or commit "
                             f"(check the spelling; `git branch -a` lists the branches)")


def read_source(spec: str, root: Path, default_path: str = DEFAULT_SCHEMA) -> tuple[str, bytes]:
    """(display name, bytes) of a schema named by a path or a git revision, relative to root. A bare
    revision (`HEAD~1`) means that revision's `default_path`."""
    path = Path(spec) if Path(spec).is_absolute() else root / spec
    if path.is_file():
        try:
            return spec, path.read_bytes()
        except OSError as exc:
            raise SourceUnavailable(f"{spec}: cannot read it: {exc.strerror or exc}") from None
    if path.is_dir():   # an existing path is never taken for a git revision
        raise SourceUnavailable(f"{spec} is a directory, not a schema file (give a schema file, a git revision "
                                f"such as HEAD~1, or REV:PATH)")
    if path.is_symlink():   # dangling or looping
        try:
            path.stat()
        except OSError as exc:
            raise SourceUnavailable(f"{spec}: cannot read it: {describe_unreadable(path, exc)}") from None
    if path.exists():
        raise SourceUnavailable(f"{spec} is not a regular file, so not a schema file (give a schema file, a git "
                                f"revision such as HEAD~1, or REV:PATH)")
    rev, sep, rel = spec.partition(":")
    rel = rel if sep else default_path
    if not rev:
        raise SourceUnavailable(f"{spec}: no such file, and not a git revision")
    if _git(root, "rev-parse", "--is-inside-work-tree").returncode != 0:
        raise SourceUnavailable(f"{spec}: no such file, and {root} is not inside a git repository")
    if not _is_commit(root, rev):
        raise _missing_revision(root, rev)
    shown = _git(root, "show", f"{rev}:./{rel}")
    if shown.returncode != 0:
        # A schema added after `rev` leaves nothing to compare with; a path that exists nowhere is a typo.
        exists_now = (root / rel).is_file()
        raise SourceUnavailable(f"git revision '{rev}' has no {rel}" +
                                ("" if exists_now else f" (and there is no {rel} in the working tree either)"),
                                no_base=exists_now)
    return f"{rev}:{rel}", shown.stdout
