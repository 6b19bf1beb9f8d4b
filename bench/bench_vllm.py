"""The canary's host time per vLLM engine step and its share of the step (run with `make bench`, which
uses .venv-vllm when `make test-vllm` built it): the demo's tiny random Llama and workload
(kv_canary.demo.vllm) in vLLM's one-process mode, guarded by kv_canary.integrations.vllm's connector,
on the torch reference, the native cpu kernels (the default on CPU tensors) and the emulated kernels,
each with the default schema and with kv_canary/schemas/isolation.yaml (the connector's `tree` and
`request_inputs` options; two tenants' cache salts, correct keying), same workload, same run, with
isolation's canary time over the default's and each backend's over the torch reference's.

Per engine step: the engine's own step (`LLMEngine.step()`: schedule, forward, sample, update; the
unguarded run's wall time per step) and the canary's work inside it, timed around the connector's
two worker hooks (before the forward: the step's request knowledge, the batch from the attention
metadata, HEAD; after it: TAIL, after_step with sweep and drain) and the scheduler side's
`build_connector_meta`. Best of `--repeats` runs. Skips with a note without vLLM.
"""
from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    from kv_canary.demo import vllm as dv
    why = dv.available()
    if why:
        print(f"bench_vllm: skipped: {why}")
        return 0
    logging.getLogger("vllm").setLevel(logging.WARNING)
    from dataclasses import replace

    from kv_canary.integrations.vllm import scheduler, worker
    # Two tenants (cache salts) over the demo's workload: the isolation schema checks a namespace per request.
    workload = replace(dv.WORKLOAD, tenants=tuple(dv.Tenant(salt=f"tenant-{'ab'[i % 4 // 2]}")
                                                  for i in range(dv.WORKLOAD.num_requests)))

    def run(options):
        llm = dv.open_llm(options, workload)
        steps = {"n": 0, "t": 0.0}
        original = llm.llm_engine.step

        def step():
            t = time.perf_counter()
            try:
                return original()
            finally:
                steps["n"] += 1
                steps["t"] += time.perf_counter() - t
        llm.llm_engine.step = step
        try:
            dv.drive(llm, workload)
            canary = dv.worker_canary()
        finally:
            dv.close_llm(llm)
        return steps, canary

    run(None)  # warm-up (imports, the model's first forwards)
    plain = min((run(None)[0] for _ in range(args.repeats)), key=lambda s: s["t"])
    print(f"vLLM {__import__('vllm').__version__} (one process, CPU), tiny Llama (2 layers, hidden 128, "
          f"{dv.KV_HEADS} KV heads), {dv.WORKLOAD.num_requests} requests x {dv.WORKLOAD.max_new_tokens} new tokens "
          f"in {dv.WORKLOAD.waves} waves (two tenants' cache salts), block size {dv.BLOCK}")
    print(f"{'backend':<10} {'schema':<10} {'steps':>5} {'engine step':>12} {'canary/step':>12} {'share':>7}   "
          f"scheduler / before forward (HEAD) / after forward (TAIL, sweep, drain) per step")
    schemas = {"default": {}, "isolation": {"tree": dv.isolation_tree_dir()}}
    step_us = plain["t"] / plain["n"] * 1e6
    ratios = []
    default_per_backend = {}
    hooks = ((scheduler.SchedulerSide, "build", "scheduler"), (worker.WorkerCanary, "before_forward", "head"),
             (worker.WorkerCanary, "after_forward", "tail"))
    for backend in ("torch", "cpu", "emulated"):
        # The schemas alternate within each repeat, so a slow spell of this shared machine hits both.
        best: dict = {}
        for _ in range(args.repeats):
            for schema, tree in schemas.items():
                m = _measured(run, {"mode": "log", "backend": backend, "sweep_interval": dv.SWEEP,
                                    "request_inputs": "vllm_namespace", **tree}, hooks)
                if schema not in best or m[0] < best[schema][0]:
                    best[schema] = m
        per_schema = {}
        for schema, (total, n, spent) in best.items():
            per = {k: v / n * 1e6 for k, v in spent.items()}
            per_schema[schema] = total / n
            print(f"{backend:<10} {schema:<10} {n:>5} {step_us:>10.0f}us {total / n * 1e6:>10.0f}us "
                  f"{total / n * 1e6 / step_us:>6.0%}   " + " / ".join(f"{per[k]:.0f}" for k in spent) + " us")
        ratios.append(f"{backend} {per_schema['isolation'] / per_schema['default']:.2f}x")
        default_per_backend[backend] = per_schema["default"]
    print("isolation.yaml's canary time per step over the default schema's: " + ", ".join(ratios))
    print("the default schema's canary time per step over the torch reference's: " + ", ".join(
        f"{b} {t / default_per_backend['torch']:.2f}x" for b, t in default_per_backend.items() if b != "torch"))
    return 0


def _measured(run, options: dict, hooks) -> tuple:
    """One guarded run: (canary seconds, forwards, seconds per hook)."""
    spent = {name: 0.0 for *_, name in hooks}
    originals = [(cls, attr, getattr(cls, attr)) for cls, attr, _ in hooks]
    for (cls, attr, name), (_, _, fn) in zip(hooks, originals):
        setattr(cls, attr, _timed(fn, spent, name))
    try:
        _, canary = run(options)
    finally:
        for cls, attr, fn in originals:
            setattr(cls, attr, fn)
    assert canary.failures == 0 and canary.manager.stats.total == 0
    return sum(spent.values()), canary.steps, spent


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
