"""GPU benchmarks of the generated kernels (issue 4 §4); prints a table, optionally writes JSON.

- verify at 2^20 entries, ALL mode, 2 real-KV sources x 256 bytes: entries/s and bytes/s, against
  a device-to-device copy of the same number of bytes measured in the same run. "Bytes" of the
  verify = what it must read per entry: the real-KV bytes, the slot's record, the predecessor's
  chained words and the four plan words. Copy bandwidth counts bytes read + bytes written (the
  usual definition); `ratio` = verify bytes/s over that (target >= 0.6).
- the same verify with SGLang's fixed 64 x 512 grid: a tree generated from kernels.yaml with the
  verify launch pinned to `fixed_grid` (the schema's way to ask for it).
- write latency: one 32,768-token prefill chain; 256 one-token decodes; both with kernels.yaml's
  write launch shape (reported), and the prefill again with SGLang's one-thread-per-request shape
  (`per_request`, a tree generated with the write launch pinned to it) for comparison.
- the prefill's floor: bench/chain_only.cu folds the same 32,768 tokens into the schema's chain in
  one thread and nothing else (compiled against the tree's header like the generated kernels);
  target: the write within 1.3x of it. Self-checking: its final link must be the link of the
  record the write stored last.
- plan latency: 256 requests x 4,096 prefix tokens.
- host time per prepared launch (write, verify, plan, scatter, validated and bound once through
  the public API, as the manager binds its launches) against a bare CuPy RawKernel launch of the
  same kernels with the same numpy-scalar arguments, measured in the same run (target: <= 2x), and
  the free function's host path (validation + binding at every call), after a self-check that the
  free functions, the prepared and the bare launches end in the same bytes (bench/host_launch.py);
- the CanaryManager's host time per step (prepare + launches + drain) for a 256-request decode
  batch and a 4 x 8,192-token prefill batch (bench/manager_steps.py).
CUDA events, warm-up, median of --repeats. Skips (exit 0, or 2 with --require-gpu) when no GPU is
visible. Each benchmark is a section: a failing one is recorded under "errors" (exit 1) and the
others still run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))  # host_launch, manager_steps

import torch  # noqa: E402

ENTRIES = 1 << 20
SOURCES, SOURCE_BYTES = 2, 256
PREFILL_TOKENS, DECODES = 32_768, 256
PLAN_REQS, PLAN_PREFIX = 256, 4096
HOST_TARGET_RATIO = 2.0  # issue 14: host time per launch <= 2x a bare RawKernel launch of the same kernels
# The manager's steps: (kind, requests, tokens, timed steps); decode = tokens of prefix per request.
MANAGER_STEPS = (("decode", 256, 2048, 8), ("prefill", 4, 8192, 5))


def gpu_available() -> bool:
    try:
        import cupy
        return bool(cupy.is_available()) and torch.cuda.is_available()
    except Exception:  # no CuPy / no driver
        return False


# GPU cycles the queue is held by torch.cuda._sleep before each timed launch (~5 ms): longer than
# the host needs to validate and launch, so the events time the kernels, not the Python before them.
HOLD_CYCLES = 10_000_000


def time_ms(fn, *, repeats: int, warmup: int = 3) -> float:
    """Median GPU time of fn's launches in ms (CUDA events). Each sample is queued behind a sleep
    kernel, so host-side validation and launch overhead does not count; without torch.cuda._sleep
    the samples include it (and the median is then an upper bound)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    hold = getattr(torch.cuda, "_sleep", None)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        if hold is not None:
            hold(HOLD_CYCLES)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def host_launch_us(fn, *, repeats: int) -> float:
    """Median host time of one call (validation + launch, no synchronisation) in microseconds."""
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t) * 1e6)
        torch.cuda.synchronize()
    return statistics.median(times)


def copy_time_ms(nbytes: int, *, repeats: int) -> float:
    """A device-to-device copy of nbytes (the bandwidth baseline of the same run)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), repeats=repeats)


def fixed_grid_tree():
    """kernels.yaml with the verify launch pinned to SGLang's 64 x 512 grid, generated to a temp dir."""
    return variant_tree("verify", {"shape": "fixed_grid", "threads": 512, "blocks": 64}, "fixed_grid")


def per_request_write_tree():
    """kernels.yaml with the write launch pinned to SGLang's one thread per request."""
    return variant_tree("write", {"shape": "per_request", "threads": 128}, "per_request_write")


def variant_tree(operation: str, launch: dict, tag: str):
    """kernels.yaml with one kernel's launch replaced, generated into the tree cache and imported."""
    import yaml

    from kv_canary.trees.schemas import generate_tree
    data = yaml.safe_load((ROOT / "kernels.yaml").read_text())
    for k in data["kernels"]:
        if k["operation"] == operation:
            k["launch"] = dict(launch)
    path = Path(tempfile.mkdtemp(prefix=f"kv_canary_{tag}_")) / f"kernels_{tag}.yaml"
    path.write_text(yaml.safe_dump(data, sort_keys=False), encoding="utf-8")
    return generate_tree(path)


class Workload:
    """256 requests x 4096 tokens on consecutive slots, written once: a clean 2^20-slot buffer."""

    def __init__(self, tree):
        import kv_canary
        self.tree, self.rt = tree, kv_canary.runtime_for(tree)
        alloc, lay = tree.allocators, tree.layout
        dev = "cuda"
        self.num_slots = ENTRIES + 1
        sources = tuple(alloc.RealKvSource(tensor=torch.randint(0, 256, (self.num_slots, SOURCE_BYTES), dtype=torch.uint8,
                                                                device=dev),
                                           page_size=1, num_bytes_per_token=SOURCE_BYTES, read_bytes=SOURCE_BYTES)
                        for _ in range(SOURCES))
        self.ctx = alloc.allocate_context(num_slots=self.num_slots, ring_capacity=1024, device=dev, real_kv_sources=sources,
                                          real_kv_hash_mode=lay.RealKvHashMode.ALL)
        self.req_to_token = (1 + torch.arange(PLAN_REQS * PLAN_PREFIX, dtype=torch.int32, device=dev)).view(PLAN_REQS, PLAN_PREFIX)
        self.req_to_token = torch.cat([torch.zeros((1, PLAN_PREFIX), dtype=torch.int32, device=dev), self.req_to_token])
        self.rows = torch.arange(1, PLAN_REQS + 1, dtype=torch.int64, device=dev)
        self.vplan = alloc.VerifyPlan.allocate(verify_capacity=ENTRIES, device=dev)
        self.wplan = alloc.WritePlan.allocate(write_req_capacity=PLAN_REQS, device=dev)
        self.extra_tokens = {f.name: torch.zeros(ENTRIES, dtype=torch.int64, device=dev) for f in lay.INPUT_FIELDS}
        self.request_values = {f.name: torch.zeros(PLAN_REQS, dtype=torch.int64, device=dev)
                               for f in lay.INPUT_FIELDS if f.verify_expected == "per_request"}
        self.slot_tables = {f.name: torch.zeros(self.num_slots, dtype=torch.int64, device=dev)
                            for f in lay.INPUT_FIELDS if f.verify_expected == "per_slot"}
        self._lens: dict = {}
        # Populate: every request is a fresh prefill of 4096 tokens (prefix 0).
        self.plan(prefix=0, extend=PLAN_PREFIX)
        self.write(input_ids=torch.randint(0, 50_000, (ENTRIES,), device=dev),
                   positions=torch.arange(PLAN_PREFIX, device=dev).repeat(PLAN_REQS),
                   out_cache_loc=self.req_to_token[1:].reshape(-1).to(torch.int64))
        # The steady state: verify the whole prefix, append one token each.
        self.plan(prefix=PLAN_PREFIX, extend=1)
        torch.cuda.synchronize()

    def plan(self, *, prefix: int, extend: int, backend="cuda"):
        key = (prefix, extend)
        if key not in self._lens:  # allocated once: the timed plan launches only the plan kernels
            self._lens[key] = tuple(torch.full((PLAN_REQS,), v, dtype=torch.int64, device="cuda") for v in key)
        prefix_lens, extend_seq_lens = self._lens[key]
        # The plan operation itself (any schema's keywords: the input-field mapping may be empty).
        self.rt.operations.PLAN.launch(self.rt, backend, dict(
            verify_plan_out=self.vplan, write_plan_out=self.wplan, req_pool_indices=self.rows,
            prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
            req_to_token=self.req_to_token, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=ENTRIES, req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0,
            extra_request_values=self.request_values))

    def write(self, *, input_ids, positions, out_cache_loc, plan=None, backend="cuda", rt=None):
        n = int(input_ids.shape[0])
        rt = rt or self.rt
        rt.operations.WRITE.launch(rt, backend, dict(
            context=self.ctx, plan=plan or self.wplan, input_ids=input_ids, positions=positions,
            out_cache_loc=out_cache_loc, enable_write_input_assert=False,
            extra_inputs={k: v[:n] for k, v in self.extra_tokens.items()}))

    def verify(self, rt=None):
        rt = rt or self.rt
        rt.operations.VERIFY.launch(rt, "cuda", dict(context=self.ctx, plan=self.vplan, check_verify_expected_token=False,
                                                     extra_slot_tables=self.slot_tables))

    def verify_bytes_per_entry(self) -> int:
        lay = self.tree.layout
        return (SOURCES * SOURCE_BYTES + lay.CANARY_RECORD_BYTES
                + lay.CANARY_WORD_BYTES * (1 + len(lay.CANARY_CHAIN_FOLD_WORDS)) + 4 * 8)


TARGET_RATIO = 0.6  # issue 4: verify >= 60% of the copy bandwidth measured in the same run
WRITE_TARGET_RATIO = 1.3  # issue 14: a prefill write within 1.3x of its chain alone
CHAIN_ONLY_SOURCE = ROOT / "bench" / "chain_only.cu"
CHAIN_ONLY_KERNEL = "kv_canary_chain_only"


def chain_only_launcher(tree, input_ids: torch.Tensor, positions: torch.Tensor):
    """(run, final_link): run() launches bench/chain_only.cu over the tokens on torch's current
    stream (one block of one warp); final_link is the int64 [1] CUDA tensor it writes."""
    import cupy
    import numpy as np

    import kv_canary
    from kv_canary.backends.cuda import load_source_module
    index = input_ids.device.index if input_ids.device.index is not None else torch.cuda.current_device()
    mods = kv_canary.runtime_for(tree).backend("cuda").warm_up(input_ids.device)   # its stream helper
    module = load_source_module(tree, CHAIN_ONLY_SOURCE.read_text(encoding="utf-8"), CHAIN_ONLY_SOURCE.name, index)
    with cupy.cuda.Device(index):
        fn = module.get_function(CHAIN_ONLY_KERNEL)
    final_link = torch.zeros(1, dtype=torch.int64, device=input_ids.device)
    args = (np.uint64(input_ids.data_ptr()), np.uint64(positions.data_ptr()), np.int64(input_ids.numel()),
            np.uint64(final_link.data_ptr()))

    def run():
        with cupy.cuda.Device(index), mods.stream(torch.cuda.current_stream(index)):
            fn((1,), (32,), args)
    return run, final_link


def stored_link(tree, canary_buf: torch.Tensor, slot: int) -> int:
    """link() of the record stored at `slot` (the torch reference's fold, on the host)."""
    ref = tree.reference
    words = canary_buf.view(torch.int64)[slot:slot + 1, :tree.layout.CANARY_FIELDS_PER_SLOT]
    return int(ref.link_t(words.cpu())[0])


def verify_grid_info(tree) -> dict:
    """The persistent verify grid actually launched (occupancy-clamped) and the compiled kernel's
    resources, so a slow verify can be explained from the report alone."""
    import kv_canary
    from kv_canary.trees.sources import kernel_abi
    kernel = kernel_abi(tree).kernel_for_operation("verify")
    entry = kernel.entry_point(check_verify_expected_token=False)
    mods = kv_canary.runtime_for(tree).backend("cuda").warm_up("cuda")
    fn = mods.functions[entry]
    info = {"sm_count": mods.sm_count, "threads": kernel.threads, "schema_blocks_per_sm": kernel.blocks_per_sm,
            "resident_blocks_per_sm": mods.resident_blocks.get(entry),
            "blocks": mods.persistent_blocks(entry, kernel.blocks_per_sm), "arch": mods.arch,
            "binary": "cubin" if mods.cubin else "ptx"}
    for attr in ("num_regs", "shared_size_bytes", "local_size_bytes"):
        try:
            info[attr] = int(getattr(fn, attr))
        except Exception as exc:  # attribute not exposed by this CuPy: keep going
            info[attr] = f"unavailable ({exc})"
    return info


def bench(repeats: int, out: dict, save) -> dict:
    """Fills `out` section by section; a failing section is recorded in out["errors"] and the
    others still run (`save()` is called after each, so a crash later loses nothing)."""
    import kv_canary
    tree = kv_canary.generated
    out.update({"device": torch.cuda.get_device_name(), "entries": ENTRIES, "errors": {}})

    def section(name, fn):
        try:
            fn()
        except Exception as exc:  # recorded, not fatal: the next section still runs
            import traceback
            out["errors"][name] = "".join(traceback.format_exception_only(type(exc), exc)).strip()
            traceback.print_exc()
        save()

    state: dict = {}

    def setup():
        state["w"] = Workload(tree)
        out["verify_grid"] = verify_grid_info(tree)
    section("setup", setup)
    if "w" not in state:
        return out
    w = state["w"]
    nbytes = ENTRIES * w.verify_bytes_per_entry()
    out["verify_bytes_per_entry"] = w.verify_bytes_per_entry()

    def copy():
        copy_ms = copy_time_ms(nbytes, repeats=repeats)
        out["copy"] = {"bytes": nbytes, "ms": copy_ms, "bandwidth_read_plus_write_Bps": 2 * nbytes / (copy_ms * 1e-3)}
    section("copy", copy)

    def verify(key, rt=None):
        def run():
            before = int(w.ctx.violation_write_index[0])
            ms = time_ms(lambda: w.verify(rt), repeats=repeats)
            torch.cuda.synchronize()
            violations = int(w.ctx.violation_write_index[0]) - before
            out[key] = _verify_result(ms, nbytes, out.get("copy"), violations,
                                      host_us=host_launch_us(lambda: w.verify(rt), repeats=repeats))
        return run
    section("verify_persistent", verify("verify_persistent"))
    section("verify_fixed_grid_64x512", lambda: verify("verify_fixed_grid_64x512",
                                                         kv_canary.runtime_for(fixed_grid_tree()))())
    if "verify_persistent" in out and "verify_fixed_grid_64x512" in out:
        # > 1: the persistent grid is faster than SGLang's fixed 64 x 512 grid.
        out["persistent_vs_fixed_grid_speedup"] = out["verify_fixed_grid_64x512"]["ms"] / out["verify_persistent"]["ms"]
    if "verify_persistent" in out and "ratio_vs_copy_bandwidth" in out["verify_persistent"]:
        out["verify_target"] = {"ratio": out["verify_persistent"]["ratio_vs_copy_bandwidth"], "target": TARGET_RATIO,
                                "met": out["verify_persistent"]["ratio_vs_copy_bandwidth"] >= TARGET_RATIO}

    alloc = tree.allocators

    from kv_canary.trees.sources import kernel_abi
    write_kernel = kernel_abi(tree).kernel_for_operation("write")
    out["write_launch"] = {"shape": write_kernel.shape, "threads": write_kernel.threads}

    def prefill_inputs() -> dict:
        # One 32,768-token prefill chain from the head to slots 1..n (its own plan: 1 request, offsets [0, n]).
        if "prefill" not in state:
            one = alloc.WritePlan.allocate(write_req_capacity=1, device="cuda")
            one.write_offsets.copy_(torch.tensor([0, PREFILL_TOKENS]))
            one.write_seed_slot_indices.fill_(-1)
            one.write_num_valid_reqs.fill_(1)
            state["prefill"] = dict(plan=one, out_cache_loc=torch.arange(1, PREFILL_TOKENS + 1, device="cuda"),
                                    input_ids=torch.randint(0, 50_000, (PREFILL_TOKENS,), device="cuda"),
                                    positions=torch.arange(PREFILL_TOKENS, device="cuda"))
        return state["prefill"]

    def prefill(key, rt=None, samples=max(3, repeats // 4)):
        def run():
            p = prefill_inputs()
            out[key] = time_ms(lambda: w.write(**p, rt=rt), repeats=samples, warmup=1)  # the first call also absorbs a compile
        return run
    section("write_prefill_32768", prefill("write_prefill_32768_ms"))

    def chain_only():
        # The same tokens through the chain alone; its final link is the last stored record's link.
        p = prefill_inputs()
        run, final_link = chain_only_launcher(tree, p["input_ids"], p["positions"])
        out["chain_only_32768_ms"] = time_ms(run, repeats=max(3, repeats // 4), warmup=1)
        torch.cuda.synchronize()
        w.write(**p)  # the records of these tokens, whatever ran before
        want = stored_link(tree, w.ctx.canary_buf, PREFILL_TOKENS)
        if int(final_link[0]) != want:
            raise AssertionError(f"chain-only final link {int(final_link[0]) & (2**64 - 1):#018x} differs from the "
                                 f"link of the prefill's last record {want & (2**64 - 1):#018x}")
        if "write_prefill_32768_ms" in out:
            ratio = out["write_prefill_32768_ms"] / out["chain_only_32768_ms"]
            out["write_prefill_vs_chain_only"] = ratio
            out["write_target"] = {"ratio": ratio, "target": WRITE_TARGET_RATIO, "met": ratio <= WRITE_TARGET_RATIO}
    section("chain_only_32768", chain_only)
    if write_kernel.shape != "per_request":
        # SGLang's shape, for the before/after: one thread fingerprints and chains all 32,768 entries.
        section("write_prefill_32768_per_request",
                lambda: prefill("write_prefill_32768_per_request_ms",
                                kv_canary.runtime_for(per_request_write_tree()), samples=3)())
        if "write_prefill_32768_ms" in out and "write_prefill_32768_per_request_ms" in out:
            out["write_prefill_speedup_vs_per_request"] = (out["write_prefill_32768_per_request_ms"]
                                                           / out["write_prefill_32768_ms"])

    def decode():
        # 256 one-token decodes, each seeded by its request's last prefix slot (the steady-state plan).
        dec = alloc.WritePlan.allocate(write_req_capacity=DECODES, device="cuda")
        dec.write_offsets.copy_(torch.arange(DECODES + 1))
        dec.write_seed_slot_indices.copy_(w.req_to_token[1:, -1].to(torch.int64))
        dec.write_num_valid_reqs.fill_(DECODES)
        dloc = w.req_to_token[1:, -1].to(torch.int64)  # rewrite the last slot (keeps the buffer valid size-wise)
        dids = torch.randint(0, 50_000, (DECODES,), device="cuda")
        dpos = torch.full((DECODES,), PLAN_PREFIX, device="cuda")
        out["write_decode_256_ms"] = time_ms(
            lambda: w.write(input_ids=dids, positions=dpos, out_cache_loc=dloc, plan=dec), repeats=repeats)
    section("write_decode_256", decode)

    def plan():
        w.plan(prefix=PLAN_PREFIX, extend=1)  # allocates its per-request tensors outside the timing
        out["plan_256x4096_ms"] = time_ms(lambda: w.plan(prefix=PLAN_PREFIX, extend=1), repeats=repeats)
    section("plan_256x4096", plan)

    def host_launch():
        import host_launch as hl
        hl.self_check(tree, "cuda", "cuda", sync=torch.cuda.synchronize)
        out["host_launch_self_check"] = "ok: free functions and prepared launches match bare RawKernel launches byte for byte"
        costs = hl.host_costs(tree, "cuda", "cuda", rounds=max(5, repeats), batch=50, sync=torch.cuda.synchronize)
        out["host_launch"] = host_launch_result(costs)
        out["host_lines"] = host_launch_lines(out)  # scripts/gpu_check.py puts them in its summary as they are
    section("host_launch", host_launch)

    def manager():
        import manager_steps as ms
        rt = kv_canary.runtime_for(tree)
        out["manager_steps"] = []
        for kind, requests, tokens, steps in MANAGER_STEPS:
            clock = ms.KernelClock(rt, "cuda", device="cuda")
            out["manager_steps"].append(ms.measure(kind, requests=requests, tokens=tokens, steps=steps, backend="cuda",
                                                   device="cuda", sync=torch.cuda.synchronize, clock=clock))
            out["host_lines"] = host_launch_lines(out)
            save()
    section("manager_steps", manager)
    return out


def host_launch_result(costs: dict) -> dict:
    """host_launch.host_costs' figures with the target verdict: every prepared launch <= HOST_TARGET_RATIO x bare."""
    worst = max(c["ratio"] for c in costs.values())
    return {"launches": costs, "target_ratio": HOST_TARGET_RATIO, "worst_ratio": worst,
            "met": worst <= HOST_TARGET_RATIO}


def host_launch_lines(r: dict) -> list:
    """Summary lines of the host launch and manager step figures (shared with scripts/gpu_check.py)."""
    lines = []
    h = r.get("host_launch")
    if h:
        parts = [f"{op} {c['launch_us']:.1f} us vs {c['bare_us']:.1f} us ({c['ratio']:.2f}x"
                 + (f"; free function {c['free_us']:.1f} us)" if c.get("free_us") else ")")
                 for op, c in h["launches"].items()]
        lines.append(f"host time per prepared launch vs a bare RawKernel launch of the same kernels: "
                     f"{'; '.join(parts)}; target <= {h['target_ratio']:.0f}x {'MET' if h['met'] else 'NOT MET'}")
    if r.get("host_launch_self_check"):
        lines.append(f"host launch self-check: {r['host_launch_self_check']}")
    if r.get("manager_steps"):
        import manager_steps as ms
        lines += [ms.describe(step) for step in r["manager_steps"]]
    return lines


def _verify_result(ms: float, nbytes: int, copy: dict | None, violations: int, *, host_us: float) -> dict:
    bps = nbytes / (ms * 1e-3)
    result = {"ms": ms, "entries_per_s": ENTRIES / (ms * 1e-3), "bytes_per_s": bps, "violations_found": violations,
              "host_launch_us": host_us}
    if copy:
        result["ratio_vs_copy_bandwidth"] = bps / copy["bandwidth_read_plus_write_Bps"]
        result["copy_same_bytes_time_ratio"] = copy["ms"] / ms
    return result


def write_target_line(r: dict) -> str:
    """The prefill write against its chain alone (scripts/gpu_check.py prints the same figures)."""
    t = r.get("write_target")
    verdict = f"target <= {WRITE_TARGET_RATIO}x: {'met' if t['met'] else 'NOT met'}" if t else "target unknown"
    return (f"prefill chain only (bench/chain_only.cu, the serial floor): {_fmt(r.get('chain_only_32768_ms'), '.3f')} ms; "
            f"write / chain only {_fmt(r.get('write_prefill_vs_chain_only'), '.2f')}x ({verdict})")


def _fmt(value, fmt: str, scale: float = 1.0) -> str:
    return format(value / scale, fmt) if isinstance(value, (int, float)) else "n/a"


def report(r: dict) -> str:
    """Human-readable lines of a (possibly partial) result dict."""
    g = r.get("verify_grid") or {}
    lines = [f"device: {r.get('device', '?')}; verify grid {g.get('blocks', '?')} x {g.get('threads', '?')} "
             f"(persistent: {g.get('sm_count', '?')} SMs x min(blocks_per_sm {g.get('schema_blocks_per_sm', '?')}, "
             f"resident {g.get('resident_blocks_per_sm', '?')}); {g.get('num_regs', '?')} registers/thread, "
             f"{g.get('shared_size_bytes', '?')} B static shared memory)"]
    c = r.get("copy")
    if c:
        lines.append(f"copy {c['bytes'] / 1e6:.0f} MB: {c['ms']:.3f} ms, "
                     f"{c['bandwidth_read_plus_write_Bps'] / 1e12:.2f} TB/s (read + write)")
    for key in ("verify_persistent", "verify_fixed_grid_64x512"):
        v = r.get(key)
        if v:
            ratio = v.get("ratio_vs_copy_bandwidth")
            lines.append(f"{key}: {v['ms']:.3f} ms, {v['entries_per_s'] / 1e9:.2f} G entries/s, "
                         f"{v['bytes_per_s'] / 1e12:.2f} TB/s read, {_fmt(ratio, '.0%')} of copy bandwidth "
                         f"(target {TARGET_RATIO:.0%}), violations {v['violations_found']}, "
                         f"host launch {_fmt(v.get('host_launch_us'), '.0f')} us")
    if "persistent_vs_fixed_grid_speedup" in r:
        lines.append(f"persistent grid vs SGLang 64 x 512: {r['persistent_vs_fixed_grid_speedup']:.2f}x")
    t = r.get("verify_target")
    if t:
        lines.append(f"verify target ({TARGET_RATIO:.0%} of copy bandwidth): {'MET' if t['met'] else 'NOT MET'} "
                     f"({t['ratio']:.0%})")
    launch = r.get("write_launch") or {}
    lines.append(f"write ({launch.get('shape', '?')}, {launch.get('threads', '?')} threads): 32,768-token prefill "
                 f"{_fmt(r.get('write_prefill_32768_ms'), '.3f')} ms; "
                 f"256 one-token decodes {_fmt(r.get('write_decode_256_ms'), '.3f')} ms")
    lines.append(write_target_line(r))
    if "write_prefill_32768_per_request_ms" in r:
        lines.append(f"write prefill with SGLang's per_request shape (one thread per request): "
                     f"{r['write_prefill_32768_per_request_ms']:.3f} ms "
                     f"({_fmt(r.get('write_prefill_speedup_vs_per_request'), '.1f')}x slower)")
    lines.append(f"plan: 256 requests x 4,096 prefix tokens {_fmt(r.get('plan_256x4096_ms'), '.3f')} ms")
    lines += r.get("host_lines") or host_launch_lines(r)
    for name, err in (r.get("errors") or {}).items():
        lines.append(f"ERROR in {name}: {err}")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here (also after each section)")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--require-gpu", action="store_true", help="exit 2 instead of 0 when no GPU is visible")
    args = parser.parse_args(argv)
    if not gpu_available():
        print("bench_gpu: skipped (no CUDA device visible to CuPy and torch)")
        return 2 if args.require_gpu else 0
    results: dict = {}

    def save():
        if args.json:
            args.json.write_text(json.dumps(results, indent=2, default=str))
    bench(args.repeats, results, save)
    print(report(results))
    return 1 if results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
