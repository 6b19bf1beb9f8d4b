"""The package as users get it: a built wheel, installed (not editable) into a fresh virtual
environment, run from a directory outside the checkout.

The fresh environment reuses this environment's third-party packages (torch, numpy, jinja2, ...)
through a path file, so nothing is downloaded; kv-canary itself comes only from the wheel, and no
top-level `codegen` package exists there.
"""
from __future__ import annotations

import shutil

import pytest
from support.wheel_env import ROOT, install_wheel, run, session_dir


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """(venv python, venv bin dir, a working directory outside the checkout, environment)."""
    return install_wheel(tmp_path_factory.mktemp("wheel"), session_dir(tmp_path_factory))


PROBE = """
import importlib.resources as r, importlib.util as u, json
import kv_canary, kv_canary.codegen, kv_canary.workflow.cli
from kv_canary.trees import csrc, emulation_build, sources
print(json.dumps({
    "top_level_codegen": u.find_spec("codegen") is not None,
    "top_level_workflow": u.find_spec("workflow") is not None,
    "files": [kv_canary.__file__, kv_canary.codegen.__file__, kv_canary.workflow.cli.__file__],
    "modules": [u.find_spec(name).origin for name in ("kv_canary.engine.distributed", "kv_canary.engine.distributed.fleet",
                                                      "kv_canary.demo.local_ranks", "kv_canary.engine.metrics",
                                                      "kv_canary.demo.fleet", "kv_canary.engine.contract",
                                                      "kv_canary.integrations.transformers.engine")],
    "shim": str(emulation_build.SHIM_HEADER), "shim_ships": emulation_build.SHIM_HEADER.is_file(),
    "csrc": str(csrc.CSRC_DIR), "csrc_headers": sorted(csrc.csrc_headers()),
    "cpu_source": str(sources.tree_dir(kv_canary.generated) / sources.kernel_abi(kv_canary.generated).CPU_SOURCE),
    "semantics": str(r.files("kv_canary") / "docs" / "semantics.md"),
}))
"""


@pytest.fixture(scope="module")
def probe(installed):
    """What the installed package holds, from one interpreter outside the checkout (one torch import
    for every check below)."""
    import json
    python, _, work, env = installed
    return json.loads(run([str(python), "-c", PROBE], cwd=work, env=env).stdout)


def test_no_top_level_codegen_or_workflow_package(probe):
    """The generator and the workflow ship inside kv_canary (kv_canary.codegen, kv_canary.workflow)."""
    assert probe["top_level_codegen"] is False and probe["top_level_workflow"] is False
    assert all("site-packages" in p and str(ROOT) not in p for p in probe["files"])


def test_the_emulation_shim_ships_in_the_wheel(probe):
    """The emulated backend builds against the shim the wheel carries as package data."""
    assert probe["shim_ships"] and "site-packages" in probe["shim"] and str(ROOT) not in probe["shim"]


def test_the_device_headers_ship_in_the_wheel(probe):
    """Every kernel includes the hand-written kv_canary/csrc/ headers: the wheel carries them all."""
    assert "site-packages" in probe["csrc"] and str(ROOT) not in probe["csrc"]
    assert probe["csrc_headers"] == sorted(p.name for p in (ROOT / "kv_canary" / "csrc").iterdir())


def test_the_cpu_backends_source_ships_in_the_wheel(probe):
    """The cpu backend builds the installed tree's cpu/kv_canary_cpu.cpp against the shipped headers."""
    import os
    assert "site-packages" in probe["cpu_source"] and os.path.isfile(probe["cpu_source"])


def test_the_behaviour_contract_ships_in_the_wheel(probe):
    """docs/semantics.md, which code, generated files and error texts cite, is readable from the wheel."""
    from pathlib import Path
    installed = Path(probe["semantics"])
    assert "site-packages" in str(installed) and str(ROOT) not in str(installed)
    assert installed.read_text(encoding="utf-8") == (ROOT / "docs" / "semantics.md").read_text(encoding="utf-8")


def test_the_fleet_and_metrics_modules_ship_in_the_wheel(probe):
    assert len(probe["modules"]) == 7 and all("site-packages" in p and str(ROOT) not in p for p in probe["modules"])


def test_describe_outside_a_checkout_prints_the_installed_layout(installed):
    _, bin_dir, work, env = installed
    out = run([str(bin_dir / "kv-canary"), "describe"], cwd=work, env=env).stdout
    shipped = (ROOT / "generated" / "LAYOUT.md").read_text(encoding="utf-8")
    assert out and out in shipped and "DO NOT EDIT" not in out


def test_generate_and_check_a_schema_outside_the_checkout(installed):
    _, bin_dir, work, env = installed
    schema = work / "mine.yaml"
    shutil.copy(ROOT / "kv_canary" / "schemas" / "wide_stride.yaml", schema)
    run([str(bin_dir / "kv-canary"), "generate", "--schema", "mine.yaml", "--out", "gen"], cwd=work, env=env)
    assert (work / "gen" / "layout.py").is_file() and (work / "gen" / "cuda" / "kv_canary_layout.cuh").is_file()
    out = run([str(bin_dir / "kv-canary"), "check", "--schema", "mine.yaml", "--out", "gen"], cwd=work, env=env).stdout
    assert "up to date" in out


def test_short_demo_runs_from_the_wheel(installed):
    """The owner_epoch scenario generates the shipped example schema at run time."""
    _, bin_dir, work, env = installed
    proc = run([str(bin_dir / "kv-canary"), "demo", "--steps", "12", "--only", "stale_transfer/owner_epoch",
                "--out", "report"], cwd=work, env={**env, "KV_CANARY_BACKEND": "torch"})
    assert "all scenarios behaved as documented" in proc.stdout
    assert (work / "report" / "report.md").is_file()
