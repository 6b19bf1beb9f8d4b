"""Host cost of kv-canary's launches on this machine's CPU (run with `make bench`); prints a table,
optionally writes JSON. Every figure below is measured in one run.

1. Per launch (write, verify, plan, scatter) and host backend (torch, emulated), with contexts
   carrying MAX_REAL_KV_SOURCES real-KV sources:
   - `prepared`: a launch validated and bound once (Runtime.bind, what CanaryManager does at attach),
     then run: against `bare`, the same kernels called without kv-canary (the emulation library's
     per-argument entry point with prebuilt arguments; for torch, the reference's operation on the
     validated arguments). Both run the kernel. Goal: prepared <= 2x bare.
   - `free function`: the host path of an SGLang-style free function, which validates every call:
     validation + backend choice + binding, the kernel not run. Goal: <= 40 us.
2. The CanaryManager's host cost per step (prepare + launches + drain, no violations;
   bench/manager_steps.py) for a 256-request decode batch (9 launches on the torch backend) and a
   4 x 8,192-token prefill batch, and at a reduced size on the emulated backend; split into kernel
   time (the reference's operations, the emulated launches) and host overhead (everything else).
   Goal: decode host overhead <= 0.70 ms per step.
3. The schema's cost: the same manager steps under kernels.yaml and kv_canary/schemas/isolation.yaml
   (a cache_namespace word, chained and verified per request), step time and the launches' kernel
   time of each, and their ratio.

Timings are the best mean of interleaved batches (this is a shared machine: the best batch is the
least disturbed one), medians for whole steps.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

import torch  # noqa: E402
from host_launch import bare  # noqa: E402

import kv_canary  # noqa: E402
from kv_canary.launch import operations  # noqa: E402
from kv_canary.launch.runtime import runtime_for  # noqa: E402

TREE = kv_canary.generated
RT = runtime_for(TREE)
RATIO_GOAL, FREE_GOAL_US = 2.0, 40.0
MANAGER_GOAL_MS = 0.70  # decode host overhead per step (9 launches on the torch backend)
LAUNCHES = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
            "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}


def interleaved_best(fns: dict, *, rounds: int, batch: int) -> dict:
    """Microseconds per call of each function: the best mean over `rounds` batches of `batch` calls,
    the functions' batches interleaved so that they meet the same machine load."""
    best = {name: float("inf") for name in fns}
    for _ in range(rounds):
        for name, fn in fns.items():
            start = time.perf_counter()
            for _ in range(batch):
                fn()
            best[name] = min(best[name], (time.perf_counter() - start) / batch * 1e6)
    return best


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def workloads() -> dict:
    """Small valid launches (host cost does not depend on sizes) with every real-KV source in use."""
    alloc, lay = TREE.allocators, TREE.layout
    sources = tuple(alloc.RealKvSource(tensor=torch.zeros((64, 128), dtype=torch.uint8), page_size=1,
                                       num_bytes_per_token=128, read_bytes=128)
                    for _ in range(lay.MAX_REAL_KV_SOURCES))
    ctx = alloc.allocate_context(num_slots=64, ring_capacity=64, device="cpu", real_kv_sources=sources,
                                 real_kv_hash_mode=lay.RealKvHashMode.ALL)
    vplan = alloc.VerifyPlan.allocate(verify_capacity=32, device="cpu")
    vplan.verify_slot_indices[:4] = _i64([3, 4, 5, 6])
    vplan.verify_prev_slot_indices[:4] = _i64([-1, 3, 4, 5])
    vplan.verify_expected_positions[:4] = _i64([0, 1, 2, 3])
    vplan.verify_num_valid.fill_(4)
    wplan = alloc.WritePlan.allocate(write_req_capacity=2, device="cpu")
    wplan.write_offsets[:3] = _i64([0, 2, 4])
    wplan.write_num_valid_reqs.fill_(2)
    fields = lay.INPUT_FIELDS
    return {
        "write": dict(context=ctx, plan=wplan, input_ids=_i64([7, 8, 9, 10]), positions=_i64([0, 1, 0, 1]),
                      out_cache_loc=_i64([3, 4, 5, 6]), enable_write_input_assert=False,
                      extra_inputs={f.name: _i64([1, 1, 2, 2]) for f in fields}),
        "verify": dict(context=ctx, plan=vplan, check_verify_expected_token=True,
                       extra_slot_tables={f.name: torch.zeros(64, dtype=torch.int64) for f in fields
                                          if f.verify_expected == "per_slot"}),
        "plan": dict(verify_plan_out=vplan, write_plan_out=wplan, req_pool_indices=_i64([1, 2]),
                     prefix_lens=_i64([2, 3]), extend_seq_lens=_i64([1, 1]),
                     req_to_token=torch.arange(1, 25, dtype=torch.int32).view(3, 8), swa_window_size=0,
                     full_to_swa_index_mapping=None, verify_capacity=32,
                     req_to_verify_expected_tokens=torch.zeros((3, 8), dtype=torch.int32),
                     req_to_verify_expected_tokens_valid_lens=_i64([8, 8]), kv_token_id_vs_position_offset=0,
                     extra_request_values={f.name: _i64([1, 2]) for f in fields if f.verify_expected == "per_request"}),
        "scatter": dict(flat_in=_i64([5, 6, 7, 8, 9]), offsets=_i64([0, 2, 5]), req_pool_indices=_i64([1, 2]),
                        pool_out=torch.zeros((3, 8), dtype=torch.int32)),
    }


def _bare(op: str, args: dict, backend: str):
    """The op's kernels without kv-canary: for emulated, its per-argument ctypes entry points with
    the values the prepared launch bound; for torch, the reference's operation on validated arguments."""
    if backend == "emulated":
        return bare(TREE, op, args, backend)
    operation = operations.BY_NAME[op]
    validated = operation.validate(RT.validators, args)
    run = operation.reference(TREE.reference)
    return (lambda: run(**validated)), 0


def launch_costs(backends: list, *, rounds: int, batch: int) -> list:
    rows = []
    for op, args in workloads().items():
        name = LAUNCHES[op]
        fns = {}
        for backend in backends:
            fns[f"prepared {backend}"] = RT.bind(name, **args, backend=backend).run
            fns[f"bare {backend}"], nargs = _bare(op, args, backend)
            fns[f"free {backend}"] = (lambda b: lambda: RT.bind(name, **args, backend=b))(backend)
        best = interleaved_best(fns, rounds=rounds, batch=batch)
        for backend in backends:
            prepared_us, bare_us, free_us = (best[f"{k} {backend}"] for k in ("prepared", "bare", "free"))
            rows.append({"launch": op, "backend": backend, "prepared_us": prepared_us, "bare_us": bare_us,
                         "ratio_to_bare": prepared_us / bare_us, "free_us": free_us,
                         "met": prepared_us <= RATIO_GOAL * bare_us and free_us <= FREE_GOAL_US})
    return rows


def launch_lines(rows: list) -> list:
    lines = [f"{'launch':<8} {'backend':<9} {'prepared':>10} {'bare call':>10} {'ratio':>6} {'free function':>14}"
             f"  goals: prepared <= {RATIO_GOAL:.0f}x bare, free function <= {FREE_GOAL_US:.0f} us"]
    for r in rows:
        lines.append(f"{r['launch']:<8} {r['backend']:<9} {r['prepared_us']:>7.1f} us {r['bare_us']:>7.1f} us "
                     f"{r['ratio_to_bare']:>5.2f}x {r['free_us']:>11.1f} us  {'met' if r['met'] else 'NOT MET'}")
    return lines


def manager_costs(*, quick: bool) -> list:
    import manager_steps as ms
    runs = [("torch", "decode", 256, 16 if quick else 64, 3 if quick else 6),
            ("torch", "prefill", 4, 1024 if quick else 8192, 2 if quick else 3)]
    if shutil.which("g++") is not None:
        runs += [("emulated", "decode", 32 if quick else 64, 16, 3), ("emulated", "prefill", 4, 256 if quick else 1024, 2)]
    out = []
    for backend, kind, requests, tokens, steps in runs:
        clock = ms.KernelClock(RT, backend)
        result = ms.measure(kind, requests=requests, tokens=tokens, steps=steps, backend=backend, device="cpu",
                            clock=clock)
        print("  " + ms.describe(result), flush=True)
        out.append(result)
    return out


def schema_costs(*, quick: bool) -> list:
    """The same manager steps under kernels.yaml and kv_canary/schemas/isolation.yaml (one more record
    word, chained and verified per request: the cost of closing the prefix-cache isolation gap),
    interleaved twice; per schema the lower of the two medians."""
    import manager_steps as ms

    from kv_canary.trees.schemas import example_schema, generate_tree

    isolation = generate_tree(example_schema("isolation"))
    runs = [("torch", "decode", 256, 16 if quick else 64, 3 if quick else 6),
            ("torch", "prefill", 4, 1024 if quick else 4096, 2 if quick else 3)]
    if shutil.which("g++") is not None:
        runs += [("emulated", "decode", 64, 16, 3), ("emulated", "prefill", 4, 256 if quick else 1024, 2)]
    out = []
    for backend, kind, requests, tokens, steps in runs:
        best: dict = {}
        for _ in range(2):
            for name, tree in (("kernels.yaml", None), ("isolation.yaml", isolation)):
                clock = ms.KernelClock(runtime_for(tree or TREE), backend)
                r = ms.measure(kind, requests=requests, tokens=tokens, steps=steps, backend=backend, device="cpu",
                               clock=clock, tree=tree)
                keep = best.get(name)
                if keep is None or r["step_ms_median"] < keep["step_ms_median"]:
                    best[name] = r
        d, i = best["kernels.yaml"], best["isolation.yaml"]
        row = {"backend": backend, "kind": kind, "requests": requests, "tokens": tokens,
               "default_step_ms": d["step_ms_median"], "isolation_step_ms": i["step_ms_median"],
               "default_kernel_ms": d["in_launch_calls_ms_median"], "isolation_kernel_ms": i["in_launch_calls_ms_median"]}
        row["step_ratio"] = row["isolation_step_ms"] / row["default_step_ms"]
        row["kernel_ratio"] = row["isolation_kernel_ms"] / max(row["default_kernel_ms"], 1e-9)
        what = (f"decode {requests} x {tokens:,} prefix" if kind == "decode" else f"prefill {requests} x {tokens:,}")
        print(f"  {backend:<8} {what:<26} step {row['default_step_ms']:7.2f} -> {row['isolation_step_ms']:7.2f} ms "
              f"({row['step_ratio']:.2f}x); write+verify+plan {row['default_kernel_ms']:7.2f} -> "
              f"{row['isolation_kernel_ms']:7.2f} ms ({row['kernel_ratio']:.2f}x)", flush=True)
        out.append(row)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and smaller manager batches")
    parser.add_argument("--launches-only", action="store_true", help="only the per-launch figures (no manager steps)")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the reference's tensors are small; a shared 2-core machine
    backends = ["torch"] + (["emulated"] if shutil.which("g++") is not None else [])
    print(f"kv-canary host launch path (torch {torch.__version__}, ctypes {ctypes.__version__})")
    rows = launch_costs(backends, rounds=40 if args.quick else 200, batch=20 if args.quick else 50)
    print("\n".join(launch_lines(rows)))
    steps = []
    if not args.launches_only:
        print(f"manager host cost per step (goal: decode host overhead <= {MANAGER_GOAL_MS:.2f} ms):")
        steps = manager_costs(quick=args.quick)
    schemas = []
    if not args.launches_only:
        print("schema cost, same work: kernels.yaml -> kv_canary/schemas/isolation.yaml (cache_namespace: one more "
              "word, chained, verified per request; manager step median, and its launches' kernel time):")
        schemas = schema_costs(quick=args.quick)
    if args.json:
        args.json.write_text(json.dumps({"launches": rows, "manager_steps": steps, "schemas": schemas}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
