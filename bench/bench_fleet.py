"""Host cost of the fleet step per rank (run with `make bench`): FleetMonitor.after_step on 2 local
gloo ranks (127.0.0.1), each serving the demo's clean workload with its own CanaryManager.

The ranks' forwards end with an all-reduce, as a tensor-parallel model's do, so the ranks step in
lockstep as they would in an engine (without it, the simulation's uneven CPU work on a shared
machine would be measured as waiting for the slower rank). Per rank: the wall time of the fleet call
in the serving loop (the step's own work runs between two calls, so the previous all-reduce has
completed when it is read: the cost is reading it and starting the next), the calls that also carry
the fleet stats, the CPU time of the calling thread (the host overhead itself, inflated here by
the caches the simulated step leaves cold), and back to back (fleet calls with nothing in between:
each read waits for a whole all-reduce round trip, the worst case; its CPU time is the overhead
with warm caches).
"""
from __future__ import annotations

import argparse
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from kv_canary.demo.local_ranks import run_local_ranks  # noqa: E402

STATS_EVERY = 50


def _timed(fleet, samples: list):
    """Replace fleet.after_step (what the manager calls) by a timed call of it: (step, wall us, CPU us)."""
    real = fleet.after_step

    def after_step(step: int) -> None:
        t, c = time.perf_counter_ns(), time.thread_time_ns()
        real(step)
        samples.append((step, (time.perf_counter_ns() - t) / 1e3, (time.thread_time_ns() - c) / 1e3))
    fleet.after_step = after_step


class TensorParallelForward:
    """An engine hook: the model's forward ends with an all-reduce across the ranks."""

    def __init__(self):
        import torch
        self.t = torch.zeros(1024)

    def during_forward(self, engine, batch) -> None:
        import torch.distributed as dist
        dist.all_reduce(self.t)


def rank_bench(rank: int, world_size: int, steps: int, loop_steps: int) -> dict:
    from kv_canary.demo import faults
    from kv_canary.demo.sim import Engine
    from kv_canary.engine.distributed import FleetMonitor
    from kv_canary.engine.manager import CanaryManager

    manager = CanaryManager(mode="log", sweep_interval=faults.SWEEP)
    engine = Engine(faults.BASE, canary=manager, hooks=[TensorParallelForward()])
    fleet = FleetMonitor(manager, stats_every=STATS_EVERY)
    serving: list = []
    _timed(fleet, serving)
    t = time.perf_counter()
    engine.run(steps)
    step_ms = (time.perf_counter() - t) / steps * 1e3
    fleet.close()
    idle = CanaryManager(mode="log", sweep_interval=0)
    Engine(faults.BASE, canary=idle)
    loop = FleetMonitor(idle, stats_every=0)
    back_to_back, back_to_back_cpu = [], []
    for step in range(loop_steps):
        t0, c0 = time.perf_counter_ns(), time.thread_time_ns()
        loop.after_step(step)
        back_to_back.append((time.perf_counter_ns() - t0) / 1e3)
        back_to_back_cpu.append((time.thread_time_ns() - c0) / 1e3)
    loop.close()
    # The first read is after the settings check and the first start: skip it.
    def carries(step: int) -> bool:
        return step > 1 and (step - 1) % STATS_EVERY == 0
    plain = [us for step, us, _ in serving[1:] if not carries(step)]
    carrying = [us for step, us, _ in serving[1:] if carries(step)]
    cpu = [c for _, _, c in serving[1:]]
    return {"rank": rank, "step_ms": step_ms, "plain": plain, "carrying": carrying, "cpu": cpu,
            "back_to_back": back_to_back[1:], "back_to_back_cpu": back_to_back_cpu[1:]}


def _summary(samples: list) -> str:
    if not samples:
        return "n/a"
    q = statistics.quantiles(samples, n=10) if len(samples) > 1 else samples * 9
    return f"median {statistics.median(samples):7.1f} us  mean {statistics.fmean(samples):7.1f} us  p90 {q[8]:7.1f} us"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--steps", type=int, default=200, help="serving steps per rank (default 200)")
    ap.add_argument("--loop-steps", type=int, default=2000, help="back-to-back fleet calls (default 2000)")
    args = ap.parse_args(argv)
    outcomes = run_local_ranks(rank_bench, 2, args=(args.steps, args.loop_steps), timeout_s=600)
    bad = [o for o in outcomes if o.status != "ok"]
    if bad:
        print("\n".join(o.describe() + "\n" + o.traceback for o in bad))
        return 1
    print(f"fleet step cost per rank, 2 gloo ranks on 127.0.0.1 ({args.steps} serving steps, "
          f"{args.loop_steps} back-to-back calls; fleet stats every {STATS_EVERY} steps)")
    for o in outcomes:
        r = o.value
        print(f"rank {r['rank']} (engine step {r['step_ms']:.1f} ms):")
        print(f"  serving loop             {_summary(r['plain'])}  ({len(r['plain'])} steps)")
        print(f"  serving, carrying stats  {_summary(r['carrying'])}  ({len(r['carrying'])} steps)")
        print(f"  serving, CPU time        {_summary(r['cpu'])}")
        print(f"  back to back             {_summary(r['back_to_back'])}")
        print(f"  back to back, CPU time   {_summary(r['back_to_back_cpu'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
