"""Host cost of kv-canary's launches on this machine's CPU (run with `make bench`); prints a table,
optionally writes JSON.

1. Per launch (write, verify, plan, scatter) and host backend (torch, emulated): the validation +
   binding a repeated launch pays before its kernel call (`Runtime.bind`: the signature lookup that
   finds the prepared launch), against, measured in the same run,
   - `bare`: one ctypes call of the kernel's per-argument emulation launcher with prebuilt
     arguments and an empty grid (it returns at once: the cost of crossing into C with that many
     arguments; the plan launches two kernels, so two calls);
   - `uncached`: what every launch did before the cache: the plain validators
     (kv_canary/validation.py) and, for the kernel backend, the generated binding of every kernel;
   - `new tensors`: a launch whose per-step inputs (host_launch.FRESH: an engine's batch tensors)
     are other tensors of the same shapes at every launch (host_launch.moved_launches): every launch
     misses the cache and is served by its shape (validation reused, moved arguments rebound).
   The target is <= 10 us per repeated launch. Contexts carry MAX_REAL_KV_SOURCES real-KV sources.
   The launch path signs its arguments with the native signer where it builds (kv_canary/native;
   the line `signer:` says which one ran); `--python-signer` measures the Python one instead.
2. The CanaryManager's host cost per step (prepare + launches + drain, no violations;
   bench/manager_steps.py) for a 256-request decode batch and a 4 x 8,192-token prefill batch on the
   torch backend, and at a reduced size on the emulated backend; split into kernel time (the
   reference's operations, the emulated launches) and host overhead (everything else).

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
from host_launch import binding_keywords, moved_launches, plan_scratch  # noqa: E402

import kv_canary  # noqa: E402
from kv_canary.cuda.sources import kernel_abi  # noqa: E402
from kv_canary.runtime import runtime_for  # noqa: E402
from kv_canary.validation import Validators  # noqa: E402

LAYER = kv_canary.generated
RT = runtime_for(LAYER)
ABI = kernel_abi(LAYER)
TARGET_US = 10.0
LAUNCHES = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
            "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}
KERNELS = {"write": ("write",), "verify": ("verify",), "plan": ("plan_offsets", "plan_entries"), "scatter": ("scatter",)}


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
    alloc, lay = LAYER.allocators, LAYER.layout
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


def _bound_kernels(op: str, args: dict) -> list:
    """(kernel, its generated binding's values) of every kernel `op` launches."""
    validated = getattr(Validators(LAYER.layout), "validate_" + op)(**args)
    scratch = plan_scratch(op, validated)
    return [(kernel, kernel.bind(**binding_keywords(ABI, kernel, op, validated, scratch)))
            for kernel in (ABI.kernel_for_template(t) for t in KERNELS[op])]


def _uncached(op: str, args: dict, backend: str):
    """The host path of a launch before the cache: plain validators, then the full binding."""
    plain = Validators(LAYER.layout)
    validate = getattr(plain, "validate_" + op)
    kernels = [ABI.kernel_for_template(t) for t in KERNELS[op]]

    def run():
        validated = validate(**args)
        if backend == "torch":
            return
        scratch = plan_scratch(op, validated)
        for kernel in kernels:
            kernel.bind(**binding_keywords(ABI, kernel, op, validated, scratch))
    return run


def _bare(op: str, args: dict):
    """ctypes calls of the op's kernels' per-argument launchers, prebuilt arguments, empty grid."""
    library = RT.backend("emulated").library
    calls = []
    for kernel, values in _bound_kernels(op, args):
        fn = library.launcher(kernel, kernel.variants[0][0])
        calls.append((fn, values))

    def run():
        for fn, values in calls:
            fn(0, 32, *values)  # an empty grid: refused at once (non-zero), nothing runs
    return run, sum(len(v) for _, v in calls)


def launch_costs(backends: list, *, rounds: int, batch: int, rt=None) -> list:
    rt = rt or RT
    rows = []
    for op, args in workloads().items():
        name = LAUNCHES[op]
        bare, nargs = _bare(op, args)
        fns = {"bare": bare}
        for backend in backends:
            getattr(rt, name)(**args, backend=backend)  # prepares (and runs) the launch once
            fns[f"cached {backend}"] = (lambda b: lambda: rt.bind(name, **args, backend=b))(backend)
            fns[f"uncached {backend}"] = _uncached(op, args, backend)
            moved = moved_launches((lambda n: lambda **kw: rt.bind(n, **kw))(name), op, args, backend)
            if moved is not None:
                fns[f"fresh {backend}"] = moved
        best = interleaved_best(fns, rounds=rounds, batch=batch)
        for backend in backends:
            cached, uncached = best[f"cached {backend}"], best[f"uncached {backend}"]
            rows.append({"launch": op, "backend": backend, "kernel_arguments": nargs, "cached_us": cached,
                         "bare_call_us": best["bare"], "ratio_to_bare": cached / best["bare"],
                         "uncached_us": uncached, "speedup_vs_uncached": uncached / cached,
                         "new_tensors_us": best.get(f"fresh {backend}"), "target_us": TARGET_US,
                         "met": cached <= TARGET_US})
    return rows


def launch_lines(rows: list) -> list:
    lines = [f"{'launch':<8} {'backend':<9} {'validation+binding':>19} {'bare ctypes call':>17} {'ratio':>6} "
             f"{'uncached':>10} {'speedup':>8} {'new tensors':>12}  target <= {TARGET_US:.0f} us"]
    for r in rows:
        fresh = f"{r['new_tensors_us']:>9.1f} us" if r.get("new_tensors_us") else f"{'-':>12}"
        lines.append(f"{r['launch']:<8} {r['backend']:<9} {r['cached_us']:>16.1f} us {r['bare_call_us']:>11.1f} us "
                     f"({r['kernel_arguments']:>2}) {r['ratio_to_bare']:>5.2f}x {r['uncached_us']:>7.1f} us "
                     f"{r['speedup_vs_uncached']:>7.1f}x {fresh}  {'met' if r['met'] else 'NOT MET'}")
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


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--quick", action="store_true", help="fewer rounds and smaller manager batches")
    parser.add_argument("--python-signer", action="store_true",
                        help="sign launch arguments with the Python signer (kv_canary/signature.py) instead of "
                             "the native one")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)  # the reference's tensors are small; a shared 2-core machine
    backends = ["torch"] + (["emulated"] if shutil.which("g++") is not None else [])
    from kv_canary import native
    from kv_canary.runtime import Runtime
    from kv_canary.signature import python_signature
    rt = Runtime(LAYER, sign=python_signature) if args.python_signer else RT
    signer = "python (--python-signer)" if args.python_signer else native.status()
    print(f"kv-canary host launch path (torch {torch.__version__}, ctypes {ctypes.__version__}); signer: {signer}")
    rows = launch_costs(backends, rounds=40 if args.quick else 200, batch=20 if args.quick else 50, rt=rt)
    print("\n".join(launch_lines(rows)))
    print("manager host cost per step:")
    steps = manager_costs(quick=args.quick)
    if args.json:
        args.json.write_text(json.dumps({"signer": signer, "launches": rows, "manager_steps": steps}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
