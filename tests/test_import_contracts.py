"""The import contracts `make lint` runs (pyproject.toml [tool.importlinter]): they hold for the
package (`make lint`), and they fail for a copy of it with an upward import and a cycle."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).parent / "lint-imports"
pytestmark = pytest.mark.skipif(not LINT.exists(), reason="import-linter is not installed (pip install -e '.[dev]')")


def lint(package_parent: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(package_parent)}
    return subprocess.run([str(LINT), str(ROOT / "pyproject.toml"), "--no-cache"], cwd=package_parent,
                          env=env, capture_output=True, text=True, timeout=120)


@pytest.fixture
def copy(tmp_path) -> Path:
    """A copy of the package's Python files (what the contracts read) in a fresh directory."""
    shutil.copytree(ROOT / "kv_canary", tmp_path / "kv_canary", ignore=shutil.ignore_patterns("__pycache__", "*.h", "*.cpp"))
    return tmp_path


def test_an_upward_import_and_a_cycle_break_the_contracts(copy):
    """(`make lint` checks the package itself; here a copy with an upward import in layer/ and a cycle
    inside engine/.)"""
    with open(copy / "kv_canary" / "layer" / "cache.py", "a", encoding="utf-8") as f:
        f.write("\nfrom ..engine import config  # noqa: E402,F401\n")
    with open(copy / "kv_canary" / "engine" / "drain.py", "a", encoding="utf-8") as f:
        f.write("\nfrom . import manager  # noqa: E402,F401\n")
    proc = lint(copy)
    assert proc.returncode != 0, proc.stdout
    assert "layers: imports only go down BROKEN" in proc.stdout
    assert "kv_canary.layer.cache -> kv_canary.engine.config" in proc.stdout
    assert "no import cycles between the modules of any package BROKEN" in proc.stdout
    assert "- .manager -> .drain (1 import)" in proc.stdout  # the one edge that would make engine/ acyclic
