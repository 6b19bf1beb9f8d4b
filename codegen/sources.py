"""Where `diff` reads a schema from: a file, or a git revision (`HEAD~1`, `main:kernels.yaml`)."""
from __future__ import annotations

import subprocess
from pathlib import Path

DEFAULT_SCHEMA = "kernels.yaml"


class SourceUnavailable(Exception):
    """The named revision or file does not exist here (e.g. a shallow clone or the first commit)."""


def _git(root: Path, *args: str) -> subprocess.CompletedProcess:
    try:
        return subprocess.run(["git", *args], cwd=root, capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise SourceUnavailable(f"cannot run git: {exc}") from None


def read_source(spec: str, root: Path) -> tuple[str, bytes]:
    """(display name, bytes) of a schema named by a path or a git revision, relative to root."""
    path = Path(spec) if Path(spec).is_absolute() else root / spec
    if path.is_file():
        return spec, path.read_bytes()
    rev, sep, rel = spec.partition(":")
    rel = rel if sep else DEFAULT_SCHEMA
    if not rev:
        raise SourceUnavailable(f"{spec}: no such file, and not a git revision")
    if _git(root, "rev-parse", "--is-inside-work-tree").returncode != 0:
        raise SourceUnavailable(f"{spec}: no such file, and {root} is not inside a git repository")
    if _git(root, "rev-parse", "--verify", "--quiet", f"{rev}^{{commit}}").returncode != 0:
        shallow = _git(root, "rev-parse", "--is-shallow-repository").stdout.strip() == b"true"
        why = "this is a shallow clone" if shallow else "no such file, branch or commit (first commit?)"
        raise SourceUnavailable(f"git revision '{rev}' is not available: {why}")
    shown = _git(root, "show", f"{rev}:./{rel}")
    if shown.returncode != 0:
        raise SourceUnavailable(f"git revision '{rev}' has no {rel}")
    return f"{rev}:{rel}", shown.stdout
