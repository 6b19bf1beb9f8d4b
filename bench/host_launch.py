"""Host time of launches against bare launches of the same kernels, and of the free functions.

Used by bench/bench_gpu.py on a GPU (backend `cuda`: the bare launch is CuPy's RawKernel call with
prebuilt numpy-scalar arguments, the usual way to launch a CuPy kernel) and by bench/bench_host.py
on the CPU with the `emulated` backend (the bare launch is the kernel's per-argument ctypes entry
point with prebuilt arguments), which is how its logic is tested without a GPU
(tests/bench/test_host_bench.py).

- `workloads(tree, device)`: one small valid launch per operation, built deterministically (two
  calls give twin states), contexts with two real-KV sources;
- `prepared(...)`: the launch validated and bound once (Runtime.bind: what the manager does at
  attach); its run is the "prepared launch";
- `bare(...)`: the same kernels launched without kv-canary: the grid and argument values the
  prepared launch bound, called directly;
- `self_check(...)`: the free functions, prepared launches and bare launches on twin states end in
  the same bytes;
- `host_costs(...)`: host microseconds per call of each (interleaved batches), and of the free
  function's host path (validation + binding, every call).
"""
from __future__ import annotations

import time

import torch

from kv_canary.launch import operations
from kv_canary.launch.runtime import runtime_for

LAUNCHES = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
            "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}
NUMPY = {"ptr": "uint64", "i64": "int64", "i32": "int32"}  # how CuPy receives each kind as a scalar
SLOTS, SOURCE_BYTES, ENTRIES = 4096, 256, 256


def workloads(tree, device, seed: int = 0) -> dict:
    """{operation: launch arguments}: a write of 4 requests, a verify of ENTRIES entries, a plan of
    4 requests, a scatter of 4 rows, over one context; the same seed gives the same state."""
    gen = torch.Generator().manual_seed(seed)
    alloc, lay = tree.allocators, tree.layout
    dev = torch.device(device)

    def randint(lo, hi, shape, dtype=torch.int64):
        return torch.randint(lo, hi, shape, generator=gen, dtype=dtype).to(dev)

    sources = tuple(alloc.RealKvSource(tensor=randint(0, 256, (SLOTS, SOURCE_BYTES), torch.uint8), page_size=1,
                                       num_bytes_per_token=SOURCE_BYTES, read_bytes=SOURCE_BYTES) for _ in range(2))
    ctx = alloc.allocate_context(num_slots=SLOTS, ring_capacity=4 * ENTRIES + 64, device=dev, real_kv_sources=sources,
                                 real_kv_hash_mode=lay.RealKvHashMode.ALL)
    ctx.canary_buf.copy_(randint(0, 256, tuple(ctx.canary_buf.shape), torch.uint8))
    vplan = alloc.VerifyPlan.allocate(verify_capacity=ENTRIES, device=dev)
    vplan.verify_slot_indices.copy_(randint(1, SLOTS, (ENTRIES,)))
    vplan.verify_prev_slot_indices.copy_(randint(-1, SLOTS, (ENTRIES,)))
    vplan.verify_expected_positions.copy_(randint(0, 64, (ENTRIES,)))
    vplan.verify_num_valid.fill_(ENTRIES)
    wplan = alloc.WritePlan.allocate(write_req_capacity=4, device=dev)
    wplan.write_offsets.copy_(torch.tensor([0, 8, 16, 24, 32], device=dev))
    wplan.write_seed_slot_indices.copy_(torch.tensor([-1, 40, 41, -1], device=dev))
    wplan.write_num_valid_reqs.fill_(4)
    slots = torch.randperm(SLOTS - 100, generator=gen)[:32].to(dev) + 100  # distinct: requests run in parallel
    fields = lay.INPUT_FIELDS
    per_request = [f.name for f in fields if f.verify_expected == "per_request"]
    rows, cols = 5, 64
    return {
        "write": dict(context=ctx, plan=wplan, input_ids=randint(0, 50_000, (32,)), positions=randint(0, 64, (32,)),
                      out_cache_loc=slots, enable_write_input_assert=False,
                      extra_inputs={f.name: randint(0, 9, (32,)) for f in fields}),
        "verify": dict(context=ctx, plan=vplan, check_verify_expected_token=True,
                       extra_slot_tables={f.name: randint(0, 9, (SLOTS,)) for f in fields
                                          if f.verify_expected == "per_slot"}),
        "plan": dict(verify_plan_out=alloc.VerifyPlan.allocate(verify_capacity=ENTRIES, device=dev),
                     write_plan_out=alloc.WritePlan.allocate(write_req_capacity=4, device=dev),
                     req_pool_indices=torch.tensor([1, 2, 3, 4], device=dev),
                     prefix_lens=torch.tensor([10, 20, 0, 30], device=dev),
                     extend_seq_lens=torch.tensor([1, 1, 5, 1], device=dev),
                     req_to_token=randint(1, SLOTS, (rows, cols), torch.int32), swa_window_size=0,
                     full_to_swa_index_mapping=None, verify_capacity=ENTRIES,
                     req_to_verify_expected_tokens=randint(0, 50_000, (rows, cols), torch.int32),
                     req_to_verify_expected_tokens_valid_lens=torch.tensor([64, 5, 0, 64], device=dev),
                     kv_token_id_vs_position_offset=0,
                     extra_request_values={name: randint(0, 9, (4,)) for name in per_request}),
        "scatter": dict(flat_in=randint(0, 50_000, (40,)), offsets=torch.tensor([0, 10, 10, 25, 40], device=dev),
                        req_pool_indices=torch.tensor([1, 3, 2, 4], device=dev),
                        pool_out=torch.zeros((rows, cols), dtype=torch.int32, device=dev)),
    }


def prepared(tree, op: str, args: dict, backend: str):
    """The public launch of `op` validated and bound once (a PreparedLaunch)."""
    return runtime_for(tree).bind(LAUNCHES[op], **args, backend=backend)


def bare(tree, op: str, args: dict, backend: str):
    """(run, argument count): `op`'s kernels launched with the grid and values its prepared launch
    bound, without kv-canary's launch path."""
    bound = prepared(tree, op, args, backend)
    chosen = runtime_for(tree).backend(backend)
    calls = []
    for kernel, entry, blocks, threads, values, _ in bound.prepared.launches:
        if backend == "cuda":
            import numpy as np
            fn = chosen.warm_up(next(t.device for t in _tensors(args))).functions[entry]
            numpy_args = tuple(getattr(np, NUMPY[k])(v) for k, v in zip(kernel.kinds, values))
            calls.append(lambda fn=fn, b=blocks, t=threads, a=numpy_args: fn((b,), (t,), a))
        else:
            fn = per_argument_entry_point(chosen.library, kernel, entry)
            calls.append(lambda fn=fn, b=blocks, t=threads, a=values: fn(b, t, *a))

    def launch(keep=bound) -> None:  # keep: the bound arguments (the plan's scratch) live as long as the calls
        for call in calls:
            if call() not in (None, 0):
                raise RuntimeError(f"bare launch of {op} failed")
    return launch, sum(len(kernel.kinds) for kernel, *_ in bound.prepared.launches)


def per_argument_entry_point(library, kernel, entry: str):
    """The emulation library's kvc_emu_launch_<entry>(grid, block, arguments...), typed by ctypes."""
    import ctypes
    types = {"ptr": ctypes.c_void_p, "i64": ctypes.c_longlong, "i32": ctypes.c_int}
    fn = getattr(library.lib, library.abi.EMULATION_LAUNCHER_PREFIX + entry)
    fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [types[k] for k in kernel.kinds]
    fn.restype = ctypes.c_int
    return fn


def _tensors(value):
    import dataclasses
    if isinstance(value, torch.Tensor):
        yield value
    elif dataclasses.is_dataclass(value) and not isinstance(value, type):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name))
    elif isinstance(value, (tuple, list)):
        for v in value:
            yield from _tensors(v)
    elif isinstance(value, dict):
        for v in value.values():
            yield from _tensors(v)


def _state(case: dict) -> list:
    """Every tensor of a case in a fixed order, on the CPU; violation rings sorted by row (GPU order)."""
    out = []
    for t in _tensors(case):
        t = t.detach().cpu()
        if t.dim() == 2 and t.dtype == torch.int64 and t.shape[0] > 1:  # a ring: rows land in any order
            t = torch.tensor(sorted(t.tolist()), dtype=t.dtype).view(t.shape)
        out.append(t)
    return out


def self_check(tree, device, backend: str, sync=lambda: None) -> None:
    """Every operation as a free function and a prepared launch, and as bare launches, on twin
    states: same bytes."""
    ours, theirs = workloads(tree, device, seed=1), workloads(tree, device, seed=1)
    rt = runtime_for(tree)
    for op in LAUNCHES:
        operations.BY_NAME[tree.api.LAUNCHES[LAUNCHES[op]]].launch(rt, backend, dict(ours[op]))
        prepared(tree, op, ours[op], backend).run()
        launch, _ = bare(tree, op, theirs[op], backend)
        launch()
        launch()
    sync()
    for op in LAUNCHES:
        a, b = _state(ours[op]), _state(theirs[op])
        bad = [i for i, (x, y) in enumerate(zip(a, b)) if x.dtype != y.dtype or x.shape != y.shape or not torch.equal(x, y)]
        if len(a) != len(b) or bad:
            raise AssertionError(f"self-check: {op} through the launch path and as bare launches differ "
                                 f"(tensors {bad} of {len(a)})")


def host_costs(tree, device, backend: str, *, rounds: int, batch: int, sync=lambda: None) -> dict:
    """{op: {launch_us, bare_us, ratio, free_us, kernel_arguments}}: host microseconds per call of
    the prepared launch and of the bare launch (best mean of interleaved batches, the device
    synchronised after each batch, never inside), and of the free function's host path
    (`free_us`: validation + binding at every call, the kernels not launched)."""
    rt = runtime_for(tree)
    case = workloads(tree, device, seed=2)
    out = {}
    for op, name in LAUNCHES.items():
        args = case[op]
        launch = prepared(tree, op, args, backend)
        bare_launch, nargs = bare(tree, op, args, backend)
        fns = {"launch": launch.run, "bare": bare_launch,
               "free": lambda name=name, args=args: rt.bind(name, **args, backend=backend)}
        best = {k: float("inf") for k in fns}
        for _ in range(rounds):
            for key, fn in fns.items():
                sync()
                start = time.perf_counter()
                for _ in range(batch):
                    fn()
                best[key] = min(best[key], (time.perf_counter() - start) / batch * 1e6)
        sync()
        out[op] = {"launch_us": best["launch"], "bare_us": best["bare"], "ratio": best["launch"] / best["bare"],
                   "free_us": best["free"], "kernel_arguments": nargs}
    return out
