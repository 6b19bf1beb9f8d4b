"""SGLang's runtime surface on a real CanaryManager (docs/semantics.md §9): each row reported once across
drains, the overflow footer, the raise text, the stats line's cadence and values, the health check,
the V-half gate and the write input assert."""
from __future__ import annotations

import collections
import logging
import re
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine.manager import CanaryManager, CanaryViolationError
from kv_canary.engine.monitor import CanaryHealthError

torch.set_num_threads(1)
SCENARIOS = {sc.name: sc for sc in faults.scenarios()}
SMALL = SimConfig(seed=4, num_pages=24, page_size=4, max_running=2, chunk_size=6, prompt_len=(4, 10),
                  output_len=(3, 8), num_system_prompts=1, system_prompt_len=4, num_swa_layers=1, swa_window=6)
HEALTH = "kv-canary: kernel_run_counter did not increase since previous check for tags=[{}] at step={}; " \
         "canary path is not executing"   # §9, verbatim


def _warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kv_canary" and r.levelno == logging.WARNING]


def _stats_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "kv_canary" and r.levelno == logging.INFO]


def _stepwise(manager, sc, steps, each=None):
    """Run scenario `sc` on `manager` step by step; `each(step)` after every step."""
    engine = Engine(sc.sim, canary=manager, hooks=[sc.make_fault()])
    for _ in range(steps):
        engine.step()
        if each is not None:
            each(engine.step_no - 1)
    return engine


# -- violation reports ------------------------------------------------------------------------
def test_log_mode_reports_each_row_once_across_drains(caplog):
    sc = SCENARIOS["late_write/bytes"]
    m = CanaryManager(mode="log")
    seen = []

    def check(step):
        new = _warnings(caplog)[len(seen):]
        seen.extend(new)
        # Each report's footer: rows appended so far, no overflow, pumped at this step.
        footer = f"  total_violations={m.stats.total} ring_overflow=False step_when_pumped={step}"
        assert [text.split("\n")[-1] for text in new] == [footer] * len(new)

    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        _stepwise(m, sc, 30, check)
        m.drain()   # nothing pending: logs nothing more
    assert m.stats.drains >= 2 and len(seen) == m.stats.total == len(m.violations) > 0
    assert _warnings(caplog) == seen
    assert [text.split("\n")[0] for text in seen] == [v.log_line() for v in m.violations]


def test_overflow_footer_counts_every_row_and_stays_set(caplog):
    sc = SCENARIOS["late_write/bytes"]
    big = CanaryManager(mode="log", ring_capacity=4096)
    logging.getLogger("kv_canary").disabled = True
    try:
        _stepwise(big, sc, 24)
    finally:
        logging.getLogger("kv_canary").disabled = False
    per_step = collections.Counter(v.step for v in big.violations)
    cap = 3
    assert max(per_step.values()) > cap
    # What the small ring must report, derived from the big ring's rows: per step min(count, cap)
    # reports, whose footer counts every row so far and flags any overflow so far.
    want, total, overflow = [], 0, False
    for step in sorted(per_step):
        total += per_step[step]
        overflow = overflow or per_step[step] > cap
        want += [f"  total_violations={total} ring_overflow={overflow} step_when_pumped={step}"] * \
            min(per_step[step], cap)
    small = CanaryManager(mode="log", ring_capacity=cap)
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        _stepwise(small, sc, 24)
    assert [text.split("\n")[-1] for text in _warnings(caplog)] == want


def test_raise_mode_raises_every_new_report_joined(caplog):
    sc = SCENARIOS["late_write/bytes"]
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        _stepwise(CanaryManager(mode="log"), sc, 30)
    first_step = re.search(r"step_when_pumped=(\d+)$", _warnings(caplog)[0]).group(1)
    first_drain = [w for w in _warnings(caplog) if w.endswith(f"step_when_pumped={first_step}")]
    raising = CanaryManager(mode="raise")
    with pytest.raises(CanaryViolationError) as info:
        _stepwise(raising, sc, 30)
    assert isinstance(info.value, RuntimeError)
    assert str(info.value) == "\n".join(first_drain)
    assert len(info.value.violations) == len(first_drain)


# -- stats line ---------------------------------------------------------------------------------
@pytest.mark.parametrize("swa", [True, False])
def test_stats_line_every_n_steps_never_at_step_zero(swa, caplog):
    cfg = SMALL if swa else replace(SMALL, num_swa_layers=0)
    m = CanaryManager(mode="raise", sweep_interval=3, stats_print_every_n_steps=4)
    engine = Engine(cfg, canary=m)
    protected = {}
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        for _ in range(13):
            engine.step()
            protected[engine.step_no - 1] = int(m.slot_run_counter[0])
    groups = 2 if swa else 1
    # Sweeps run at steps s with s % 3 == 2, so by step S there were (S + 1) // 3; 3 phases x 2
    # halves per pool group; the default schema's 12 launch tags (docs/semantics.md §3).
    assert _stats_lines(caplog) == [
        f"[canary] step={s} protected_tokens={protected[s]} sweep_passes={(s + 1) // 3} violations=0 "
        f"launch_tags_active={6 * groups}/12" for s in (4, 8, 12)]
    assert protected[4] > 0


def test_stats_cadence_one_skips_step_zero_and_zero_means_never(caplog):
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        Engine(SMALL, canary=CanaryManager(mode="log", stats_print_every_n_steps=1)).run(3)
    assert [line.split()[1] for line in _stats_lines(caplog)] == ["step=1", "step=2"]
    caplog.clear()
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        Engine(SMALL, canary=CanaryManager(mode="log", stats_print_every_n_steps=0)).run(3)
    assert _stats_lines(caplog) == []


def test_stats_line_counts_violations_so_far(caplog):
    sc = SCENARIOS["late_write/bytes"]
    m = CanaryManager(mode="log", stats_print_every_n_steps=2)
    totals = {}
    logging.getLogger("kv_canary").setLevel(logging.INFO)
    try:
        with caplog.at_level(logging.INFO, logger="kv_canary"):
            _stepwise(m, sc, 24, lambda step: totals.__setitem__(step, m.stats.total))
    finally:
        logging.getLogger("kv_canary").setLevel(logging.NOTSET)
    got = {int(re.search(r"step=(\d+)", line).group(1)): int(re.search(r"violations=(\d+)", line).group(1))
           for line in _stats_lines(caplog)}
    assert got == {s: totals[s] for s in range(2, 24, 2)} and got[22] > 0


# -- health check -------------------------------------------------------------------------------
class KernelRunsOnly:
    """Stands in for the manager's runtime: a verify or write launch only advances its context's
    kernel-run counter (all the health check reads); plans and scatters do nothing. Keeps the 200
    steps these tests need cheap; the manager under test is the real one."""

    def __init__(self, rt):
        self.rt = rt

    def bind(self, name, **arguments):
        counter = arguments["context"].kernel_run_counter if "context" in arguments else None
        return SimpleNamespace(run=(lambda: counter.add_(1)) if counter is not None else (lambda: None))

    def __getattr__(self, name):
        return getattr(self.rt, name)


class SkipTail:
    """An engine-side bug: from step `start` on, the TAIL launches are never made."""

    def __init__(self, manager, start: int):
        self.m, self.start = manager, start

    def __getattr__(self, name):
        return getattr(self.m, name)

    def tail(self, batch) -> None:
        if batch.step < self.start:
            self.m.tail(batch)


def _health_run(cfg, steps, *, start=0, **kwargs):
    m = CanaryManager(real_kv_hash_mode="NONE", **kwargs)
    m.rt = KernelRunsOnly(m.rt)
    engine = Engine(cfg, canary=SkipTail(m, start))
    with pytest.raises(CanaryHealthError) as info:
        engine.run(steps)
    return engine, info.value


def test_health_check_names_tags_that_stopped_since_the_previous_check():
    # TAIL runs through step 100: the check at 100 passes, the one at 200 compares with it and fails.
    engine, err = _health_run(SMALL, 250, start=101, mode="log", sweep_interval=0)
    assert isinstance(err, RuntimeError) and engine.step_no == 200   # raised by after_step(200)
    assert str(err) == HEALTH.format("TAIL_K_FULL, TAIL_V_FULL, TAIL_K_SWA, TAIL_V_SWA", 200)


@pytest.mark.parametrize("mode", ["raise", "log"])
def test_health_check_skips_v_tags_when_v_is_not_checked(mode):
    engine, err = _health_run(SMALL, 150, mode=mode, sweep_interval=0, enable_mha_v=False)
    assert engine.step_no == 100
    assert str(err) == HEALTH.format("TAIL_K_FULL, TAIL_K_SWA", 100)


def test_health_check_covers_only_the_engines_pools():
    engine, err = _health_run(replace(SMALL, num_swa_layers=0), 150, mode="log", sweep_interval=0)
    assert str(err) == HEALTH.format("TAIL_K_FULL, TAIL_V_FULL", 100)


def test_health_check_expects_sweeps_only_with_a_sweep_interval(monkeypatch):
    m = CanaryManager(mode="log", real_kv_hash_mode="NONE", sweep_interval=7)
    m.rt = KernelRunsOnly(m.rt)
    monkeypatch.setattr(m, "sweep", lambda: 0)   # a sweep that never launches
    with pytest.raises(CanaryHealthError) as info:
        Engine(SMALL, canary=m).run(150)
    assert str(info.value) == HEALTH.format("SWEEP_K_FULL, SWEEP_V_FULL, SWEEP_K_SWA, SWEEP_V_SWA", 100)
    quiet = CanaryManager(mode="log", real_kv_hash_mode="NONE", sweep_interval=0)
    quiet.rt = KernelRunsOnly(quiet.rt)
    Engine(SMALL, canary=quiet).run(201)   # two checks pass: no sweep is owed without an interval
    assert quiet.sweep_passes == 0


def test_health_check_owes_nothing_for_steps_without_a_forward():
    m = CanaryManager(mode="raise", sweep_interval=0)
    Engine(SMALL, canary=m)   # attaches; its steps are never run
    for step in range(201):
        m.after_step(step)   # an idle engine: no batch, no launch, no error
    assert m.kernel_runs == 0


def test_an_empty_sweep_still_launches():
    m = CanaryManager(mode="raise", sweep_interval=4)
    engine = Engine(SMALL, canary=m)   # attached, nothing cached yet
    assert engine.cached_entries()[0] == [] and m.sweep() == 0
    runs = dict(zip((t.name for t in m.tags), m.kernel_run_counters.tolist()))
    sweeps = {m.L.launch_tag("sweep", h, g).name for h in ("k", "v") for g in ("full", "swa")}
    assert {name: n for name, n in runs.items() if n} == dict.fromkeys(sweeps, 1)
    assert m.sweep_passes == 1 and m.stats.total == 0


# -- V half and the write input assert ----------------------------------------------------------
def test_v_launches_do_not_run_when_v_is_not_checked():
    m = CanaryManager(mode="raise", sweep_interval=2, enable_mha_v=False)
    Engine(SMALL, canary=m).run(6)
    runs = dict(zip((t.name for t in m.tags), m.kernel_run_counters.tolist()))
    L = m.L
    for tag, (phase, half, group) in L.LAUNCH_TAG_COORDINATES.items():
        assert (runs[tag.name] > 0) == (half == "k"), tag.name
    assert all(set(g.bufs) == {"k"} for g in m.groups)


def _until_damage(manager, sc):
    """Run scenario `sc` until its fault fires (that step included), then drain; returns the fault."""
    fault = sc.make_fault()
    engine = Engine(sc.sim, canary=manager, hooks=[fault])
    logging.getLogger("kv_canary").disabled = True
    try:
        while fault.damage_step is None and engine.step_no < sc.steps:
            engine.step()
        manager.drain()
    finally:
        logging.getLogger("kv_canary").disabled = False
    assert fault.damage_step is not None
    return fault


def test_write_input_assert_catches_a_wrong_input_token_at_the_write():
    sc = SCENARIOS["wrong_token_at_chunk_boundary"]
    m = CanaryManager(mode="log", enable_write_input_assert=True, check_verify_expected_token=False)
    fault = _until_damage(m, sc)
    pos, given, true = map(int, re.search(r"position (\d+): token (\d+) instead of (\d+)", fault.detail).groups())
    first = m.violations[0]
    assert (first.step, first.launch_tag, first.reasons) == (fault.damage_step, "HEAD_K_FULL", ("WRITE_TOKEN_MISMATCH",))
    assert (first.position, first.stored_token, first.expected_token, first.expected_aux) == (pos, given, true, pos)
    plain = CanaryManager(mode="log", check_verify_expected_token=False)
    _until_damage(plain, sc)
    assert plain.stats.total == 0   # without the assert the same write goes unnoticed


def test_write_input_assert_is_silent_on_a_clean_run_with_drafts():
    m = CanaryManager(mode="raise", enable_write_input_assert=True, sweep_interval=4)
    Engine(replace(SMALL, spec_draft_tokens=2, max_ctx=64), canary=m).run(30)
    m.drain()
    assert m.stats.total == 0 and m.kernel_runs > 0
