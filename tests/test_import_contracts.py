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
    """A copy of the packages' Python files (what the contracts read: kv_canary, the generator, the
    workflow and the default generated tree) in a fresh directory."""
    for package in ("kv_canary", "codegen", "workflow", "generated"):
        shutil.copytree(ROOT / package, tmp_path / package,
                        ignore=shutil.ignore_patterns("__pycache__", "*.h", "*.cpp", "*.cu", "*.cuh", "*.j2"))
    return tmp_path


def test_an_upward_import_and_a_cycle_break_the_contracts(copy):
    """(`make lint` checks the package itself; here a copy with an upward import in trees/ and a cycle
    inside engine/.)"""
    with open(copy / "kv_canary" / "trees" / "cache.py", "a", encoding="utf-8") as f:
        f.write("\nfrom ..engine import config  # noqa: E402,F401\n")
    with open(copy / "kv_canary" / "engine" / "drain.py", "a", encoding="utf-8") as f:
        f.write("\nfrom . import manager  # noqa: E402,F401\n")
    proc = lint(copy)
    assert proc.returncode != 0, proc.stdout
    assert "tiers: imports only go down BROKEN" in proc.stdout
    assert "kv_canary.trees.cache -> kv_canary.engine.config" in proc.stdout
    assert "no import cycles between the modules of any package BROKEN" in proc.stdout
    assert "- .manager -> .drain (1 import)" in proc.stdout  # the one edge that would make engine/ acyclic


def test_a_cycle_in_the_generator_breaks_the_contracts(copy):
    """codegen/ is under the contracts too: the commands share codegen/trees.py, so trees.py importing
    cli.py (which imports trees.py) is a cycle."""
    with open(copy / "codegen" / "trees.py", "a", encoding="utf-8") as f:
        f.write("\nfrom .cli import trees_of  # noqa: E402,F401\n")
    proc = lint(copy)
    assert proc.returncode != 0, proc.stdout
    assert "no import cycles between the modules of any package BROKEN" in proc.stdout
    assert "codegen" in proc.stdout


def test_a_cycle_in_the_workflow_breaks_the_contracts(copy):
    with open(copy / "workflow" / "base.py", "a", encoding="utf-8") as f:
        f.write("\nfrom . import report  # noqa: E402,F401\n")
    proc = lint(copy)
    assert "no import cycles between the modules of any package BROKEN" in proc.stdout, proc.stdout
    assert "workflow" in proc.stdout


def test_the_generator_may_not_import_the_workflow(copy):
    """The workflow sits beside the generator and imports it; the generator never imports the workflow."""
    with open(copy / "codegen" / "cli.py", "a", encoding="utf-8") as f:
        f.write("\nimport workflow.report  # noqa: E402,F401\n")
    proc = lint(copy)
    assert "the generator imports nothing of the workflow BROKEN" in proc.stdout, proc.stdout
    assert "codegen.cli -> workflow.report" in proc.stdout


def test_the_workflow_may_not_import_the_runtime(copy):
    with open(copy / "workflow" / "report.py", "a", encoding="utf-8") as f:
        f.write("\nimport kv_canary.engine  # noqa: E402,F401\n")
    proc = lint(copy)
    assert "the workflow imports nothing of the runtime BROKEN" in proc.stdout, proc.stdout


def test_the_generator_may_not_import_the_runtime(copy):
    with open(copy / "codegen" / "render.py", "a", encoding="utf-8") as f:
        f.write("\nimport kv_canary.launch  # noqa: E402,F401\n")
    proc = lint(copy)
    assert "the generator imports nothing of the runtime BROKEN" in proc.stdout, proc.stdout
