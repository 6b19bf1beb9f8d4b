"""What each rank of the fleet tests runs (kv_canary.demo.local_ranks pickles these by name, so they
live in a module of their own). Every phase is a real serving simulation with a real CanaryManager
and FleetMonitor; a phase returns what this rank saw, and the test compares the ranks."""
from __future__ import annotations

import contextlib
import logging
import os
import time
from datetime import timedelta

import torch.distributed as dist

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine.distributed import FleetCollectiveError, FleetMonitor
from kv_canary.engine.manager import CanaryManager, CanaryViolationError
from kv_canary.engine.monitor import CanaryHealthError

# Small and cheap: no radix cache, no SWA pool; the fault below fires at FAULT_STEP.
SIM = SimConfig(seed=4, num_pages=24, page_size=4, max_running=2, chunk_size=6, prompt_len=(4, 10),
                output_len=(3, 8), num_system_prompts=0, num_swa_layers=0, radix_cache=False)
FAULT_STEP = 3
CANARY = {"real_kv_hash_mode": "NONE", "enable_mha_v": False, "sweep_interval": 0, "stats_print_every_n_steps": 0}
SHORT_TIMEOUT_S = 2.0


class FleetLines(logging.Handler):
    """The fleet lines this rank logs (the decision line and the stats line)."""

    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        text = record.getMessage()
        if text.startswith(("kv-canary fleet:", "[canary fleet]")):
            self.lines.append(text)


class SkipTail:
    """An engine-side bug: the TAIL launches are never made (the health check must notice)."""

    def __init__(self, manager):
        self.m = manager

    def __getattr__(self, name):
        return getattr(self.m, name)

    def tail(self, batch) -> None:
        pass


@contextlib.contextmanager
def one_rank_group(backend: str, *, timeout_s: int):
    """A world of one rank in this process (an in-memory store): the group, destroyed on exit."""
    dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timedelta(seconds=timeout_s))
    try:
        yield dist.group.WORLD
    finally:
        dist.destroy_process_group()


def phase(rank: int, *, mode: str, steps: int, fault_rank=None, stall_tail_rank=None, group=None,
          stats_every: int = 4, first_step: int = 0, **manager) -> dict:
    """Serve `steps` steps with a fleet; the fault (an out-of-range slot) only on `fault_rank`, the
    TAIL launches skipped only on `stall_tail_rank`. Returns this rank's view."""
    log = logging.getLogger("kv_canary")
    handler = FleetLines()
    log.addHandler(handler)
    log.setLevel(logging.INFO)
    log.propagate = False
    m = CanaryManager(mode=mode, **{**CANARY, **manager})
    hooks = [faults.OutOfRangeSlot(FAULT_STEP)] if rank == fault_rank else []
    engine = Engine(SIM, canary=SkipTail(m) if rank == stall_tail_rank else m, hooks=hooks)
    engine.step_no = first_step
    fleet = FleetMonitor(m, group, stats_every=stats_every)
    raised = None
    try:
        for _ in range(steps):
            engine.step()
        fleet.close()
    except (CanaryViolationError, CanaryHealthError) as e:
        raised = {"type": type(e).__name__, "step": m.last_step, "rows": len(getattr(e, "violations", [])),
                  "decision": _decision(e.decision), "text": str(e)}
    finally:
        log.removeHandler(handler)
    stats = fleet.last_stats
    return {"decisions": [_decision(d) for d in fleet.decisions], "lines": handler.lines, "raised": raised,
            "local_rows": m.stats.total, "first_local_step": min(m.stats.by_step, default=None),
            "counters": [m.kernel_run_counters.tolist(), int(m.slot_run_counter[0]), m.reason_counts.tolist(),
                         m.stats.total, m.stats.lost],
            "last_stats": None if stats is None else
            [stats.step, [[list(s.kernel_runs), s.protected_tokens, list(s.by_reason), s.rows, s.lost]
                          for s in stats.per_rank]],
            "exchanges": fleet.exchanges}


def _decision(d) -> list:
    return [d.step, d.decided_step, d.violation_ranks, d.health_ranks]


def four_ranks(rank: int, world_size: int) -> dict:
    """A clean run; a fault on rank 2 (log); a fault on rank 1 (raise); rank 3's TAIL launches
    stalled (health); ranks 1 and 3 configured differently (refused)."""
    out = {
        "clean": phase(rank, mode="log", steps=8),
        "log": phase(rank, mode="log", steps=8, fault_rank=2),
        "raise": phase(rank, mode="raise", steps=8, fault_rank=1),
        # The health check runs at step 100: start just before it.
        "health": phase(rank, mode="log", steps=6, stall_tail_rank=3, first_step=97),
    }
    m = CanaryManager(mode="raise" if rank in (1, 3) else "log", **CANARY)
    Engine(SIM, canary=m)
    try:
        FleetMonitor(m)
        out["settings"] = None
    except ValueError as e:
        out["settings"] = str(e)
    return out


def four_ranks_one_leaves(rank: int, world_size: int) -> dict:
    """Rank 3 leaves the fleet early, in a group with a short timeout."""
    short = dist.new_group(list(range(world_size)), timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    return leave_early(rank, leaving_rank=world_size - 1, group=short)


def leave_early(rank: int, *, leaving_rank: int, group) -> dict:
    """Every rank serves; `leaving_rank` exits (no error, no goodbye) after 3 steps. After the error,
    the next step raises it again at once, and close() detaches without a collective."""
    m = CanaryManager(mode="raise", **CANARY)
    engine = Engine(SIM, canary=m)
    fleet = FleetMonitor(m, group)
    out = {"error": None}
    try:
        for i in range(10):
            if rank == leaving_rank and i == 3:
                os._exit(0)
            engine.step()
    except FleetCollectiveError as e:
        out = {"error": str(e), "step": m.last_step}
    try:
        engine.step()
        out["again"] = None
    except FleetCollectiveError as e:
        out["again"] = str(e)
    fleet.close()
    out["detached"] = m.listener(FleetMonitor) is None
    return out


def two_ranks_one_stalls(rank: int, world_size: int, gave_up: str) -> dict:
    """Rank 1 stalls (alive, holding its connections, but no longer stepping) until rank 0 has given
    up (rank 0 then creates the file `gave_up`). Mode raise, and rank 0's fault fires in the step
    whose exchange never completes."""
    short = dist.new_group([0, 1], timeout=timedelta(seconds=SHORT_TIMEOUT_S))
    m = CanaryManager(mode="raise", **CANARY)
    engine = Engine(SIM, canary=m, hooks=[faults.OutOfRangeSlot(FAULT_STEP)] if rank == 0 else [])
    FleetMonitor(m, short)
    started = time.monotonic()
    try:
        for i in range(10):
            if rank == 1 and i == 3:
                deadline = time.monotonic() + 60
                while not os.path.exists(gave_up) and time.monotonic() < deadline:
                    time.sleep(0.01)
                os._exit(0)
            engine.step()
        out = {"error": None, "step": m.last_step}
    except FleetCollectiveError as e:
        out = {"error": str(e), "step": m.last_step, "seconds": time.monotonic() - started}
    open(gave_up, "w").close()
    return out
