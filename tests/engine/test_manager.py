"""CanaryManager driven by the simulation: clean runs, modes, draining and overflow accounting."""
from __future__ import annotations

import collections
import dataclasses
import logging
import os

import pytest
import torch

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine.manager import CanaryManager, CanaryViolationError

torch.set_num_threads(1)
STEPS = int(os.environ.get("KV_CANARY_SIM_STEPS", "60"))
SEEDS = range(int(os.environ.get("KV_CANARY_SIM_SEEDS", "1")))
SCENARIOS = {sc.name: sc for sc in faults.scenarios()}


def _run(manager, cfg=faults.BASE, steps=STEPS, hooks=()):
    engine = Engine(cfg, canary=manager, hooks=list(hooks))
    engine.run(steps)
    manager.drain()
    return engine


@pytest.mark.parametrize("seed", SEEDS)
def test_clean_run_has_no_violations(seed):
    m = CanaryManager(mode="raise", sweep_interval=5)
    e = _run(m, SimConfig(seed=seed, num_pages=40, chunk_size=6, spec_draft_tokens=1), steps=STEPS * 2)
    assert m.stats.total == 0 and not m.violations
    assert any(r.matched for r in e.finished)   # prefix sharing was exercised
    assert len(m.groups) == 2                   # FULL and SWA
    # 2 plans + 16 verify/write launches per step, 4 sweep launches per sweep, 1 scatter per admission.
    assert m.kernel_runs >= STEPS * 2 * 16


def test_clean_run_on_every_tree(any_tree):
    # The namespaces of isolation.yaml's request_input field (never asked for by the other trees).
    m = CanaryManager(tree=any_tree, mode="raise", sweep_interval=4, request_inputs=faults.SIM_REQUEST_INPUTS)
    _run(m, SimConfig(seed=9, num_pages=40))
    assert m.stats.total == 0


def test_raise_mode_names_the_first_violation():
    sc = SCENARIOS["out_of_range_slot"]
    m = CanaryManager(mode="raise")
    with pytest.raises(CanaryViolationError) as info:
        _run(m, sc.sim, hooks=[sc.make_fault()])
    err = info.value
    first = err.violations[0]
    assert first.launch_tag == "HEAD_K_FULL" and first.reasons == ("SLOT_OUT_OF_RANGE",)
    # One report of 7 lines per row (docs/semantics.md §9), in ring order, drained at the damage step.
    lines = str(err).split("\n")
    assert len(lines) == 7 * len(err.violations)
    assert lines[0::7] == [v.log_line() for v in err.violations]
    footer = f"  total_violations={len(err.violations)} ring_overflow=False step_when_pumped={first.step}"
    assert lines[6::7] == [footer] * len(err.violations)


def test_log_mode_logs_one_report_per_row(caplog):
    sc = SCENARIOS["late_write/bytes"]
    m = CanaryManager(mode="log")
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        _run(m, sc.sim, steps=20, hooks=[sc.make_fault()])
    reports = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert m.violations and len(reports) == len(m.violations) == m.stats.total
    assert [r.split("\n")[0] for r in reports] == [v.log_line() for v in m.violations]


def test_off_mode_launches_nothing():
    sc = SCENARIOS["late_write/bytes"]
    m = CanaryManager(mode="off")
    fault = sc.make_fault()
    _run(m, sc.sim, steps=20, hooks=[fault])
    assert fault.damage_step is not None
    assert m.kernel_runs == 0 and m.stats.total == 0 and not m.groups


def test_overflow_accounting_is_exact():
    sc = SCENARIOS["late_write/bytes"]
    big = CanaryManager(mode="log", ring_capacity=4096)
    _run(big, sc.sim, steps=24, hooks=[sc.make_fault()])
    per_step = collections.Counter(v.step for v in big.violations)
    assert big.stats.lost == 0 and sum(per_step.values()) == big.stats.total > 0
    assert max(per_step.values()) > 3
    # With nothing lost, the device's per-reason totals are those of the decoded rows.
    assert big.stats.by_reason == collections.Counter(r for v in big.violations for r in v.reasons)

    cap = 3
    small = CanaryManager(mode="log", ring_capacity=cap)
    logging.getLogger("kv_canary").disabled = True
    try:
        _run(small, sc.sim, steps=24, hooks=[sc.make_fault()])
    finally:
        logging.getLogger("kv_canary").disabled = False
    # The host drains every step on the CPU, so each step's rows past `cap` are the lost ones.
    assert small.stats.total == big.stats.total
    assert small.stats.lost == sum(max(0, n - cap) for n in per_step.values())
    assert dict(small.stats.by_step) == dict(per_step)
    kept = [v for s in sorted(per_step) for v in [x for x in big.violations if x.step == s][:cap]]
    assert small.violations == kept
    # Per-reason totals keep counting after the ring is full: the dropped rows' reasons count too.
    assert small.stats.lost > 0
    assert small.stats.by_reason == big.stats.by_reason
    assert small.stats.by_reason != collections.Counter(r for v in kept for r in v.reasons)


def test_grouping_puts_the_root_first():
    sc = SCENARIOS["slot_reuse_while_referenced"]
    m = CanaryManager(mode="log")
    logging.getLogger("kv_canary").disabled = True
    try:
        _run(m, sc.sim, steps=12, hooks=[sc.make_fault()])
    finally:
        logging.getLogger("kv_canary").disabled = False
    groups = m.grouped()
    assert any(g.cascade for g in groups)
    for g in groups:
        same_launch = [v for v in m.violations if (v.step, v.launch_tag) == (g.root.step, g.root.launch_tag)]
        # The root follows no violating slot; every downstream row follows a slot of its group.
        assert g.root.expected_aux & (2**64 - 1) not in {m.link_of(v) for v in same_launch if v.slot != g.root.slot}
        links = {m.link_of(v) for v in (g.root, *g.cascade)}
        for v in g.cascade:
            assert (v.step, v.launch_tag) == (g.root.step, g.root.launch_tag)
            assert v.expected_aux & (2**64 - 1) in links


@pytest.mark.parametrize("kwargs, match", [
    (dict(mode="loud"), "mode must be one of none, log, raise \\('off' = 'none'\\), got 'loud'"),
    (dict(real_kv_hash_mode="SOME"), "real_kv_hash_mode must be one of NONE, PARTIAL, ALL, got 'SOME'"),
    (dict(ring_capacity=0), "ring_capacity must be an int >= 1, got 0"),
    (dict(sweep_interval=-1), "sweep_interval must be an int >= 0, got -1"),
])
def test_bad_arguments(kwargs, match):
    with pytest.raises(ValueError, match=match):
        CanaryManager(**kwargs)


@pytest.mark.parametrize("name", ["slot_reuse_while_referenced", "stale_transfer/owner_epoch", "off_by_one_after_spec"])
def test_tables_follow_the_work_and_growth_changes_nothing(name):
    """Per-request and per-token tables start at `initial_context` columns and grow on demand (the
    launches rebound) to what the longest context needs, never to the engine's max_ctx; the canary
    then sees exactly what one with tables sized to max_ctx sees."""
    sc = SCENARIOS[name]
    tree = faults.owner_epoch_tree() if sc.tree == "owner_epoch" else None
    cfg = dataclasses.replace(sc.sim, max_ctx=512)   # a cache far longer than any request here
    runs = []
    for initial in (2, 512):
        m = CanaryManager(tree=tree, mode="log", sweep_interval=faults.SWEEP, enable_write_input_assert=True,
                          initial_context=initial, **sc.manager)
        e = Engine(cfg, canary=m, hooks=[sc.make_fault()])
        logging.getLogger("kv_canary").setLevel(logging.ERROR)
        e.run(sc.steps)
        m.drain()
        runs.append((m, e))
    (grown, engine), (sized, _) = runs
    longest = max(len(r.tokens) for r in engine.finished + engine.running)
    assert grown.resizes > 0 and sized.resizes == 0
    assert longest <= grown.ctx_cols < 4 * (longest + cfg.max_running * cfg.chunk_size) < 512 == sized.ctx_cols
    assert grown.req_pool.shape[1] == grown.ctx_cols and grown.token_capacity == grown.write_capacity * grown.ctx_cols
    assert grown.violations == sized.violations and grown.stats.total == sized.stats.total > 0
    assert grown.kernel_runs == sized.kernel_runs


def test_a_row_whose_tokens_were_never_reported_gets_the_whole_context():
    m = CanaryManager(mode="log", initial_context=2)
    e = Engine(faults.BASE, canary=m)
    m.on_tokens = lambda *a, **k: None      # an engine that skips the protocol's on_tokens
    with pytest.warns(UserWarning, match="tokens were never reported"):
        e.run(3)
    assert m.ctx_cols == faults.BASE.max_ctx
