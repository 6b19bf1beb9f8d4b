"""The fleet decision and the fleet stats (kv_canary.engine.distributed) on real gloo process groups of 2
and 4 local ranks, each serving the simulation with its own CanaryManager and FleetMonitor
(tests/support/fleet_workers.py); then, in this process, a world without a process group and a one-rank
group. Every multi-rank run has a hard timeout after which the launcher kills every rank."""
from __future__ import annotations

import logging

import pytest
import torch
import torch.distributed as dist
from support import fleet_workers as fw

from kv_canary.demo import faults
from kv_canary.demo.local_ranks import run_local_ranks
from kv_canary.demo.sim import Engine
from kv_canary.engine.distributed import FleetMonitor, FleetViolationError
from kv_canary.engine.manager import CanaryManager, CanaryViolationError
from kv_canary.engine.violations import sglang_reason_name

torch.set_num_threads(1)
HARD_TIMEOUT_S = 120   # per multi-rank run (it normally takes a few seconds)
L = CanaryManager().L
# The fault's expected launch and reason, as the fault scenarios declare them.
EXPECT = next(sc.expect for sc in faults.scenarios() if sc.name == "out_of_range_slot")
REASON = sglang_reason_name(EXPECT.reason)


def _values(outcomes) -> list:
    assert [o.status for o in outcomes] == ["ok"] * len(outcomes), [o.describe() + "\n" + o.traceback
                                                                   for o in outcomes]
    return [o.value for o in outcomes]


@pytest.fixture(scope="module")
def four():
    """Every phase of fleet_workers.four_ranks, per rank."""
    return _values(run_local_ranks(fw.four_ranks, 4, timeout_s=HARD_TIMEOUT_S, group_timeout_s=60))


def _per_rank(four, phase: str) -> list[dict]:
    return [rank[phase] for rank in four]


def _fleet_stats_equal_each_ranks_counters(view: list[dict]) -> None:
    """The fleet stats every rank holds after close(): rank r's row equals rank r's own counters."""
    assert all(v["last_stats"] == view[0]["last_stats"] for v in view)
    step, per_rank = view[0]["last_stats"]
    assert per_rank == [v["counters"] for v in view]


def test_a_clean_fleet_sees_nothing_and_its_stats_are_every_ranks_counters(four):
    view = _per_rank(four, "clean")
    assert [v["decisions"] for v in view] == [[]] * 4 and [v["local_rows"] for v in view] == [0] * 4
    _fleet_stats_equal_each_ranks_counters(view)
    assert all(v["counters"][0] == view[0]["counters"][0] and sum(v["counters"][0]) > 0 for v in view)
    # Rank 0 logs the stats lines (steps 4 and 8 ride one step later; close() carries step 7's end),
    # nobody logs a decision line.
    stats_lines = [line for line in view[0]["lines"] if line.startswith("[canary fleet]")]
    assert [line.split()[2] for line in stats_lines] == ["step=4", "step=7"]
    assert "violations=0" in stats_lines[-1] and "ranks_with_violations=[]" in stats_lines[-1]
    assert all(v["lines"] == [] for v in view[1:])


def test_log_mode_a_fault_on_one_rank_is_decided_on_every_rank_at_the_same_step(four):
    view = _per_rank(four, "log")
    rows = view[2]["local_rows"]
    assert rows > 0 and view[2]["first_local_step"] == fw.FAULT_STEP
    assert [v["local_rows"] for v in view] == [0, 0, rows, 0]
    # Every rank holds the same decision: the step rank 2 saw it, acted on one step later.
    assert [v["decisions"] for v in view] == [[[fw.FAULT_STEP, fw.FAULT_STEP + 1, [2], []]]] * 4
    line = (f"kv-canary fleet: step={fw.FAULT_STEP} violations on ranks=[2] of world_size=4: rank 2: rows={rows} "
            f"{REASON}={rows}; every rank acts at step={fw.FAULT_STEP + 1}")
    assert [x for x in view[0]["lines"] if x.startswith("kv-canary fleet:")] == [line]   # rank 0 logs it
    assert all(v["lines"] == [] for v in view[1:])
    _fleet_stats_equal_each_ranks_counters(view)
    assert "ranks_with_violations=[2]" in view[0]["lines"][-1]


def test_raise_mode_every_rank_raises_at_the_same_step(four):
    view = _per_rank(four, "raise")
    raised = [v["raised"] for v in view]
    assert [r["type"] for r in raised] == ["FleetViolationError"] * 4
    assert [r["step"] for r in raised] == [fw.FAULT_STEP + 1] * 4
    assert [r["decision"] for r in raised] == [[fw.FAULT_STEP, fw.FAULT_STEP + 1, [1], []]] * 4
    # Each rank's error carries its own rows: rank 1's, nobody else's.
    assert [r["rows"] for r in raised] == [0, view[1]["local_rows"], 0, 0] and view[1]["local_rows"] > 0
    first = raised[0]["text"].splitlines()[0]
    assert all(r["text"].splitlines()[0] == first for r in raised) and "violations on ranks=[1]" in first
    tag = EXPECT.tag(L)
    assert f"kv_canary violation: launch_tag={tag} fail_reason={REASON}" in raised[1]["text"]
    assert "kv_canary violation:" not in raised[0]["text"]


def test_a_health_failure_on_one_rank_raises_on_every_rank(four):
    view = _per_rank(four, "health")
    raised = [v["raised"] for v in view]
    assert [r["type"] for r in raised] == ["FleetHealthError"] * 4   # in mode log too
    assert [r["decision"] for r in raised] == [[100, 101, [], [3]]] * 4
    assert [r["step"] for r in raised] == [101] * 4
    stalled = L.launch_tag("tail", "k", "full").name   # V is not checked in these runs
    assert f"rank 3: health check failed at step=100 for tags=[{stalled}]" in raised[0]["text"]
    # Rank 3's error also carries its own health-check text (docs/semantics.md §9).
    assert f"kernel_run_counter did not increase since previous check for tags=[{stalled}] at step=100" \
        in raised[3]["text"]


def test_ranks_with_other_canary_settings_are_refused_on_every_rank(four):
    errors = [rank["settings"] for rank in four]
    assert errors[0] is not None and errors == [errors[0]] * 4
    assert "same canary settings on every rank" in errors[0]
    assert "rank 1 has mode=raise (rank 0: log)" in errors[0] and "rank 3 has mode=raise (rank 0: log)" in errors[0]


def test_a_rank_that_leaves_early_fails_the_others_with_a_clear_error():
    outcomes = run_local_ranks(fw.four_ranks_one_leaves, 4, timeout_s=HARD_TIMEOUT_S, group_timeout_s=60)
    assert outcomes[3].status == "exited" and outcomes[3].exitcode == 0
    survivors = _values(outcomes[:3])
    for v in survivors:
        assert v["error"] is not None, v
        assert "the fleet's decision all_reduce started at step=" in v["error"]
        assert f"the group's timeout is {fw.SHORT_TIMEOUT_S:g} s" in v["error"]
        # The group is unusable now: the next step says so at once; close() just detaches.
        assert v["again"].startswith(v["error"]) and "the fleet stopped at that step" in v["again"]
        assert v["detached"]


def test_a_stalled_rank_fails_the_others_after_the_groups_timeout(tmp_path):
    outcomes = run_local_ranks(fw.two_ranks_one_stalls, 2, args=(str(tmp_path / "gave_up"),),
                               timeout_s=HARD_TIMEOUT_S, group_timeout_s=60)
    assert outcomes[1].status == "exited"
    (v,) = _values(outcomes[:1])
    # Rank 1 stepped through step 2: rank 0's read of step 3's exchange (at step 4) gives up.
    assert v["step"] == fw.FAULT_STEP + 1, v
    assert f"the fleet's decision all_reduce started at step={fw.FAULT_STEP}" in v["error"]
    assert f"the group's timeout is {fw.SHORT_TIMEOUT_S:g} s" in v["error"]
    # Rank 0's own violation (step 3, deferred to that exchange) is not lost with it.
    assert "this rank's own canary errors, not shared with the fleet:" in v["error"]
    assert f"kv_canary violation: launch_tag={EXPECT.tag(L)} fail_reason={REASON}" in v["error"]


# -- one process ----------------------------------------------------------------------------------
def _fault_run(mode: str, *, group=None, active=None, steps=8):
    m = CanaryManager(mode=mode, **fw.CANARY)
    engine = Engine(fw.SIM, canary=m, hooks=[faults.OutOfRangeSlot(fw.FAULT_STEP)])
    fleet = FleetMonitor(m, group, stats_every=2, active=active)
    return m, engine, fleet


def test_without_a_process_group_the_manager_behaves_as_before():
    assert not dist.is_initialized()
    m, engine, fleet = _fault_run("raise")
    assert not fleet.active and m.listener(FleetMonitor) is None
    with pytest.raises(CanaryViolationError) as info:
        engine.run(8)
    assert type(info.value) is CanaryViolationError and m.last_step == fw.FAULT_STEP   # raised at once, locally
    with pytest.raises(ValueError, match="torch.distributed is not initialised"):
        FleetMonitor(m, active=True)


@pytest.fixture
def one_rank_group():
    with fw.one_rank_group("gloo", timeout_s=30) as group:
        yield group


def test_a_one_rank_group_keeps_todays_behaviour_unless_asked(one_rank_group, caplog):
    m, engine, fleet = _fault_run("raise")
    assert not fleet.active and m.listener(FleetMonitor) is None
    with pytest.raises(CanaryViolationError):
        engine.run(8)
    assert m.last_step == fw.FAULT_STEP
    # active=True runs the fleet on one rank: the raise moves to the next step, as in a fleet.
    m, engine, fleet = _fault_run("raise", active=True)
    assert fleet.active and m.listener(FleetMonitor) is fleet and fleet.device == torch.device("cpu")
    with pytest.raises(FleetViolationError) as info:
        engine.run(8)
    assert m.last_step == fw.FAULT_STEP + 1 and len(info.value.violations) == m.stats.total > 0
    assert (info.value.decision.step, info.value.decision.violation_ranks) == (fw.FAULT_STEP, [0])
    # Log mode: the fleet line, the stats lines, and close()'s final exchange.
    m, engine, fleet = _fault_run("log", active=True)
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        engine.run(6)
        fleet.close()
    assert m.listener(FleetMonitor) is None and fleet.exchanges == 7   # steps 0..4 read at steps 1..5; close() reads 5 and its own
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith(("kv-canary fleet", "[canary fleet"))]
    assert [line.split()[2] for line in lines] == ["step=2", "step=3", "step=4", "step=5"]
    assert lines[1].startswith(f"kv-canary fleet: step={fw.FAULT_STEP} violations on ranks=[0]")
    s = fleet.last_stats
    assert s.step == 5 and (s.per_rank[0].kernel_runs, s.per_rank[0].protected_tokens, s.per_rank[0].rows) == \
        (tuple(m.kernel_run_counters.tolist()), int(m.slot_run_counter[0]), m.stats.total)
    assert s.by_reason == tuple(m.reason_counts.tolist())


def test_bad_arguments_are_named(one_rank_group):
    m = CanaryManager(mode="log")
    with pytest.raises(ValueError, match="attached to its engine"):
        FleetMonitor(m)
    with pytest.raises(ValueError, match="needs a CanaryManager, got dict"):
        FleetMonitor({})
    Engine(fw.SIM, canary=m)
    for kwargs, text in (({"stats_every": -1}, "stats_every must be an int >= 0, got -1"),
                         ({"timeout": 0}, "timeout must be positive seconds or a timedelta, got "),
                         ({"active": "yes"}, "active must be None, True or False, got 'yes'")):
        with pytest.raises(ValueError, match=text):
            FleetMonitor(m, active=kwargs.pop("active", True), **kwargs)
    FleetMonitor(m, active=True)
    with pytest.raises(ValueError, match="already has a FleetMonitor"):
        FleetMonitor(m, active=True)
