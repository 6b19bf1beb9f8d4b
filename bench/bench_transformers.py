"""The canary's added host time per engine step on HF transformers' continuous batching (run with
`make bench`): the demo's tiny random Llama and workload (kv_canary.demo.transformers), guarded by
kv_canary.integrations.transformers, on the torch reference, the native cpu kernels (the default on
CPU tensors) and the emulated kernels.

Per engine step: the engine's own step (prepare, forward, sample, update: the unguarded run's wall
time per step) and the canary's work inside it, timed around each hook (reading the batch from the
engine's objects, HEAD, TAIL, after_step with sweep and drain, release bookkeeping). Best of
`--repeats` runs (a shared machine: the least disturbed run). Skips with a note without transformers.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from kv_canary.demo import transformers as tf
    why = tf.available()
    if why:
        print(f"bench_transformers: skipped: {why}")
        return 0
    import torch

    from kv_canary.engine.manager import CanaryManager
    from kv_canary.integrations.transformers import engine as tengine
    torch.set_num_threads(1)
    model = tf.model()
    def plain() -> float:
        t = time.perf_counter()
        tf.generate(model)
        return time.perf_counter() - t

    plain()  # warm-up
    best_plain = min(plain() for _ in range(args.repeats))
    print(f"transformers {__import__('transformers').__version__}, tiny Llama (2 layers, hidden 64), "
          f"{tf.WORKLOAD.num_requests} requests x {tf.WORKLOAD.max_new_tokens} new tokens, page size {tf.PAGE_SIZE}")
    print(f"{'backend':<10} {'steps':>5} {'engine step':>12} {'canary/step':>12} {'share':>7}   "
          f"batch / head / tail / after_step per step")
    for backend in ("torch", "cpu", "emulated"):
        best = None
        for _ in range(args.repeats):
            spent = {"batch": 0.0, "head": 0.0, "tail": 0.0, "after_step": 0.0}
            manager = CanaryManager(backend=backend, sweep_interval=tf.SWEEP)
            for name in ("head", "tail", "after_step"):
                setattr(manager, name, _timed(getattr(manager, name), spent, name))
            original = tengine.TransformersEngine.batch
            tengine.TransformersEngine.batch = _timed(original, spent, "batch")
            try:
                canary, _ = tf.run(manager)
            finally:
                tengine.TransformersEngine.batch = original
            canary.check()
            total = sum(spent.values())
            if best is None or total < best[0]:
                best = (total, canary.steps, dict(spent))
        total, steps, spent = best
        step_us = best_plain / steps * 1e6
        per = {k: v / steps * 1e6 for k, v in spent.items()}
        print(f"{backend:<10} {steps:>5} {step_us:>10.0f}us {total / steps * 1e6:>10.0f}us "
              f"{total / steps * 1e6 / step_us:>6.0%}   " + " / ".join(f"{per[k]:.0f}" for k in spent) + " us")
    return 0


def _timed(fn, spent: dict, name: str):
    def run(*args, **kwargs):
        t = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[name] += time.perf_counter() - t
    return run


if __name__ == "__main__":
    sys.exit(main())
