"""`make setup`: install the development environment into the running interpreter's venv, fast.

A fresh `make test` spends a third of its time here, most of it unpacking wheels one after the
other. So torch (with its own dependencies) and the other packages are installed by two pip runs at
once; their sets are disjoint (the other run leaves out torch and what torch itself requires of
ours, jinja2), so no package is written by both. Then one `pip install -e .[dev]` is the
authoritative step: it resolves everything, installs whatever the parallel runs did not (a failure
there is not fatal, only slower) and installs kv-canary itself. Pins stay in pyproject.toml.

Usage: .venv/bin/python scripts/setup_venv.py   (the Makefile's setup target)
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PIP = [sys.executable, "-m", "pip", "install", "-q", "--no-compile"]


def parallel_groups() -> list[list[str]]:
    """[torch's requirement], [every other requirement of the dev install but torch's own]."""
    try:
        import tomllib
    except ImportError:  # Python 3.10: no parallel warm-up, the final install does it all
        return []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["project"]
    wanted = list(project["dependencies"]) + list(project["optional-dependencies"]["dev"])
    torch = [r for r in wanted if r.startswith("torch")]
    others = [r for r in wanted if not r.startswith(("torch", "jinja2"))]  # jinja2: torch requires it too
    return [torch, others] if torch else []


def main() -> int:
    runs = [subprocess.Popen(PIP + group) for group in parallel_groups() if group]
    for run in runs:
        run.wait()  # not checked: the install below is the one that must succeed
    return subprocess.run(PIP + ["-e", ".[dev]"], cwd=ROOT).returncode


if __name__ == "__main__":
    sys.exit(main())
