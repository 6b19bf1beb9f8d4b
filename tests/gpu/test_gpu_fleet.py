"""The fleet decision and the fleet stats with CUDA tensors: the manager and the simulation on the
GPU, a one-rank NCCL group (kv_canary.engine.distributed's NCCL path: the row staged through pinned memory,
the all-reduce on the device, the result copied back behind an event and read one step later).
Needs no prometheus_client. Skipped cleanly where torch sees no CUDA device or has no NCCL, except
under KV_CANARY_REQUIRE_GPU=1 (scripts/gpu_check.py sets it), where that must fail instead."""
from __future__ import annotations

import logging
import os

import pytest
import torch
import torch.distributed as dist
from support import fleet_workers as fw

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine
from kv_canary.engine.distributed import FleetMonitor, FleetViolationError
from kv_canary.engine.manager import CanaryManager


def _gpu_with_nccl() -> bool:
    try:
        return torch.cuda.is_available() and dist.is_available() and dist.is_nccl_available()
    except Exception:
        return False


pytestmark = pytest.mark.skipif(not _gpu_with_nccl() and not os.environ.get("KV_CANARY_REQUIRE_GPU"),
                                reason="no CUDA device with NCCL visible to torch")
STEPS = 8


@pytest.fixture(scope="module")
def nccl_group():
    torch.cuda.set_device(0)
    with fw.one_rank_group("nccl", timeout_s=120) as group:
        yield group


def _run(mode: str, group):
    m = CanaryManager(mode=mode, **fw.CANARY)
    engine = Engine(fw.SIM, canary=m, hooks=[faults.OutOfRangeSlot(fw.FAULT_STEP)], device="cuda")
    fleet = FleetMonitor(m, group, stats_every=2, active=True)
    assert fleet.active and fleet.device.type == "cuda" and m.kernel_run_counters.is_cuda
    return m, engine, fleet


def test_the_fleet_decides_and_reduces_stats_with_cuda_tensors_under_nccl(nccl_group, caplog):
    m, engine, fleet = _run("log", nccl_group)
    rows_after = {}   # step -> rows this rank had drained by the end of it
    with caplog.at_level(logging.INFO, logger="kv_canary"):
        for _ in range(STEPS):
            engine.step()
            rows_after[engine.step_no - 1] = m.stats.total
        m.drain()       # rows still in the ring: close() shares them with the fleet
        fleet.close()
    assert m.stats.total > 0 and m.listener(FleetMonitor) is None
    # The first decision is about the first step whose drain found rows (on CUDA the drain reads an
    # asynchronous copy, so that may be a step after the damage), acted on one step later.
    first = min(s for s, n in rows_after.items() if n)
    d = fleet.decisions[0]
    assert (d.step, d.decided_step, d.violation_ranks, d.health_ranks) == (first, first + 1, [0], [])
    # Every drained row was shared exactly once, close() included.
    assert sum(r.rows for d in fleet.decisions for r in d.reports) == m.stats.total
    lines = [r.getMessage() for r in caplog.records]
    assert any(x.startswith(f"kv-canary fleet: step={first} violations on ranks=[0] of world_size=1") for x in lines)
    # close() carried the final counters: the fleet stats equal the manager's own.
    s = fleet.last_stats
    assert s is not None and s.step == STEPS - 1
    mine = s.per_rank[0]
    assert mine.kernel_runs == tuple(m.kernel_run_counters.tolist()) and sum(mine.kernel_runs) > 0
    assert mine.protected_tokens == int(m.slot_run_counter[0]) > 0
    assert mine.by_reason == tuple(m.reason_counts.tolist())
    assert (mine.rows, mine.lost) == (m.stats.total, m.stats.lost)
    assert any(x.startswith(f"[canary fleet] step={STEPS - 1} world_size=1 ") for x in lines)


def test_raise_mode_raises_at_the_fleet_decision_with_cuda_tensors(nccl_group):
    m, engine, fleet = _run("raise", nccl_group)
    rows_after = {}
    with pytest.raises(FleetViolationError) as info:
        for _ in range(STEPS):
            engine.step()
            rows_after[engine.step_no - 1] = m.stats.total
    first = min(s for s, n in rows_after.items() if n)
    assert m.last_step == first + 1 and info.value.decision.step == first
    assert info.value.decision.violation_ranks == [0]
    assert len(info.value.violations) == m.stats.total > 0
