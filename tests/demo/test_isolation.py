"""Prefix-cache isolation in the simulation: when the prefix cache's key drops the namespace, a
tenant (or LoRA adapter) reuses another one's cached prompt prefix. The default record is blind to
it by construction; kv_canary/schemas/isolation.yaml reports exactly the reused pages at the reader's
first verify, with its own reason. (Every scenario's verdict, the controls' included, is
tests/demo/test_faults.py::test_scenario.)"""
from __future__ import annotations

import shutil

import pytest
import torch

from kv_canary.demo import faults, report
from kv_canary.demo.sim import Engine
from kv_canary.engine.manager import CanaryManager

torch.set_num_threads(1)
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
SCENARIOS = {sc.name: sc for sc in faults.scenarios()}


def _until_damage(sc, tree, backend=None):
    """The scenario's run up to and including its damage step, every check on."""
    manager = CanaryManager(tree=tree, mode="log", sweep_interval=faults.SWEEP, backend=backend, **sc.manager)
    fault = sc.make_fault()
    engine = Engine(sc.sim, canary=manager, hooks=[fault])
    while fault.damage_step is None and engine.step_no < sc.steps:
        engine.step()
    manager.drain()
    return engine, manager, fault


@pytest.mark.parametrize("name, backend", [("cross_tenant_prefix/isolation", "torch"),
                                           ("cross_adapter_prefix/isolation", "torch"),
                                           pytest.param("cross_tenant_prefix/isolation", "emulated", marks=needs_gxx)])
def test_isolation_reports_exactly_the_reused_pages_where_the_default_record_is_blind(name, backend):
    sc = SCENARIOS[name]
    engine, m, fault = _until_damage(sc, faults.example_tree("isolation"), backend)
    reader, pages = fault.reused
    ps = engine.cfg.page_size
    foreign = {p * ps + i for p in pages for i in range(ps)}
    first = m.violations[0]
    assert (first.step, first.launch_tag) == (fault.damage_step, "HEAD_K_FULL")
    launch = [v for v in m.violations if (v.step, v.launch_tag) == (first.step, first.launch_tag)]
    # Only the namespace check fires (tokens, positions, chain and K/V bytes all match), on exactly the
    # reused slots, at their positions in the reader's prompt.
    assert {v.reasons for v in launch} == {("VERIFY_NAMESPACE_MISMATCH",)}
    assert {v.slot for v in launch} == foreign
    assert sorted(v.position for v in launch) == list(range(len(foreign)))
    assert all(v.stored_token == v.expected_token for v in launch)
    assert sum(n for s, n in m.stats.by_step.items() if s < fault.damage_step) == 0
    # The same run under the default schema, every check on: the same reuse, nothing reported.
    _, blind, same = _until_damage(sc, None, backend)
    assert (same.damage_step, same.reused[0].rid, same.reused[1]) == (fault.damage_step, reader.rid, pages)
    assert blind.check_verify_expected_token and blind.real_kv_hash_mode.name == "ALL"
    assert blind.stats.total == 0


def test_the_demo_says_default_blind_isolation_catches_it(tmp_path, capsys):
    from kv_canary.demo.cli import main
    rc = main(["--steps", "3", "--out", str(tmp_path), "--only", report.ISOLATION_PAIR[0],
               "--only", report.ISOLATION_PAIR[1]])
    out = capsys.readouterr().out
    assert rc == 0
    line = next(x for x in out.splitlines() if x.startswith("prefix-cache isolation"))
    assert "default schema blind (0 violations), isolation schema catches it: HEAD_K_FULL verify_namespace" in line
    assert line in (tmp_path / "report.md").read_text()


def test_init_from_isolation_gives_the_engine_a_package_that_catches_it(tmp_path, monkeypatch, capsys):
    """`kv-canary init --from isolation` in an engine repository: its canary.yaml is the example, and the
    package it generates, loaded as the engine would, catches the cross-tenant hit (`init` alone: blind)."""
    from kv_canary.codegen.load import load_schema_text

    from kv_canary.cli import main as kv_main
    from kv_canary.trees.loader import load_generated

    caught = {}
    for source in ("isolation", "default"):
        repo = tmp_path / source
        (repo / "myengine").mkdir(parents=True)
        (repo / "myengine" / "__init__.py").write_text("")
        monkeypatch.chdir(repo)
        assert kv_main(["init", "--from", source, "--package", "myengine/_canary"]) == 0
        schema = load_schema_text((repo / "canary.yaml").read_text())
        fields = {f.name: f.source for f in schema.canary.fields if f.role == "input"}
        assert fields == ({"cache_namespace": "request_input"} if source == "isolation" else {})
        tree = load_generated(repo / "myengine" / "_canary", f"isolation_test_{source}_canary")
        _, m, fault = _until_damage(SCENARIOS["cross_tenant_prefix/isolation"], tree)
        assert fault.reused is not None
        caught[source] = sorted({r for v in m.violations for r in v.reasons})
    capsys.readouterr()
    assert caught == {"isolation": ["VERIFY_NAMESPACE_MISMATCH"], "default": []}
