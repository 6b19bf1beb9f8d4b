"""GPU benchmarks of the generated kernels (issue 4 §4); prints a table, optionally writes JSON.

- verify at 2^20 entries, ALL mode, 2 real-KV sources x 256 bytes: entries/s and bytes/s, against
  a device-to-device copy of the same number of bytes measured in the same run. "Bytes" of the
  verify = what it must read per entry: the real-KV bytes, the slot's record, the predecessor's
  chained words and the four plan words. Copy bandwidth counts bytes read + bytes written (the
  usual definition); `ratio` = verify bytes/s over that (target >= 0.6).
- the same verify with SGLang's fixed 64 x 512 grid: a layer generated from kernels.yaml with the
  verify launch pinned to `fixed_grid` (the schema's way to ask for it).
- write latency: one 32,768-token prefill chain; 256 one-token decodes.
- plan latency: 256 requests x 4,096 prefix tokens.
CUDA events, warm-up, median of --repeats. Skips (exit 0) when no GPU is visible.
"""
from __future__ import annotations

import argparse
import importlib
import json
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import torch  # noqa: E402

ENTRIES = 1 << 20
SOURCES, SOURCE_BYTES = 2, 256
PREFILL_TOKENS, DECODES = 32_768, 256
PLAN_REQS, PLAN_PREFIX = 256, 4096


def gpu_available() -> bool:
    try:
        import cupy
        return bool(cupy.is_available()) and torch.cuda.is_available()
    except Exception:  # no CuPy / no driver
        return False


def time_ms(fn, *, repeats: int, warmup: int = 3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def copy_time_ms(nbytes: int, *, repeats: int) -> float:
    """A device-to-device copy of nbytes (the bandwidth baseline of the same run)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return time_ms(lambda: dst.copy_(src), repeats=repeats)


def fixed_grid_layer():
    """kernels.yaml with the verify launch pinned to SGLang's 64 x 512 grid, generated to a temp dir."""
    import yaml

    from codegen.load import load_schema_text
    from codegen.render import render_all
    from codegen.writer import write_tree
    from kv_canary._loader import load_generated
    data = yaml.safe_load((ROOT / "kernels.yaml").read_text())
    for k in data["kernels"]:
        if k["template"] == "verify":
            k["launch"] = {"shape": "fixed_grid", "threads": 512, "blocks": 64}
    text = yaml.safe_dump(data, sort_keys=False)
    out = Path(tempfile.mkdtemp(prefix="kv_canary_fixed_grid_"))
    write_tree(out, render_all(load_schema_text(text, "kernels_fixed_grid.yaml"), text))
    return load_generated(out, "kv_canary_bench_fixed_grid")


class Workload:
    """256 requests x 4096 tokens on consecutive slots, written once: a clean 2^20-slot buffer."""

    def __init__(self, layer):
        import kv_canary
        self.layer, self.rt = layer, kv_canary.runtime_for(layer)
        alloc, lay = importlib.import_module(layer.__name__ + ".allocators"), layer.layout
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
        # Populate: every request is a fresh prefill of 4096 tokens (prefix 0).
        self.plan(prefix=0, extend=PLAN_PREFIX)
        self.write(input_ids=torch.randint(0, 50_000, (ENTRIES,), device=dev),
                   positions=torch.arange(PLAN_PREFIX, device=dev).repeat(PLAN_REQS),
                   out_cache_loc=self.req_to_token[1:].reshape(-1).to(torch.int64))
        # The steady state: verify the whole prefix, append one token each.
        self.plan(prefix=PLAN_PREFIX, extend=1)
        torch.cuda.synchronize()

    def plan(self, *, prefix: int, extend: int, backend="cuda"):
        dev = "cuda"
        self.rt.launch_canary_plan_kernels(
            verify_plan_out=self.vplan, write_plan_out=self.wplan, req_pool_indices=self.rows,
            prefix_lens=torch.full((PLAN_REQS,), prefix, dtype=torch.int64, device=dev),
            extend_seq_lens=torch.full((PLAN_REQS,), extend, dtype=torch.int64, device=dev),
            req_to_token=self.req_to_token, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=ENTRIES, req_to_verify_expected_tokens=None,
            req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0,
            extra_request_values=self.request_values, backend=backend)

    def write(self, *, input_ids, positions, out_cache_loc, plan=None, backend="cuda"):
        n = int(input_ids.shape[0])
        self.rt.launch_canary_write_kernel(context=self.ctx, plan=plan or self.wplan, input_ids=input_ids,
                                           positions=positions, out_cache_loc=out_cache_loc,
                                           enable_write_input_assert=False,
                                           extra_inputs={k: v[:n] for k, v in self.extra_tokens.items()}, backend=backend)

    def verify(self, rt=None):
        (rt or self.rt).launch_canary_verify_kernel(context=self.ctx, plan=self.vplan, check_verify_expected_token=False,
                                                    extra_slot_tables=self.slot_tables, backend="cuda")

    def verify_bytes_per_entry(self) -> int:
        lay = self.layer.layout
        return (SOURCES * SOURCE_BYTES + lay.CANARY_RECORD_BYTES
                + lay.CANARY_WORD_BYTES * (1 + len(lay.CANARY_CHAIN_FOLD_WORDS)) + 4 * 8)


def bench(repeats: int) -> dict:
    import kv_canary
    from kv_canary.cuda.sources import kernel_abi
    layer = kv_canary.generated
    out: dict = {"device": torch.cuda.get_device_name(), "entries": ENTRIES}
    w = Workload(layer)
    sm = torch.cuda.get_device_properties(0).multi_processor_count
    verify_kernel = kernel_abi(layer).kernel_for_template("verify")
    out["verify_grid"] = f"{sm * verify_kernel.blocks_per_sm} x {verify_kernel.threads} (persistent, {sm} SMs)"

    nbytes = ENTRIES * w.verify_bytes_per_entry()
    copy_ms = copy_time_ms(nbytes, repeats=repeats)
    copy_bw = 2 * nbytes / (copy_ms * 1e-3)  # read + write
    out["copy"] = {"bytes": nbytes, "ms": copy_ms, "bandwidth_read_plus_write_Bps": copy_bw}

    before = int(w.ctx.violation_write_index[0])
    verify_ms = time_ms(w.verify, repeats=repeats)
    torch.cuda.synchronize()
    violations = int(w.ctx.violation_write_index[0]) - before
    out["verify_persistent"] = _verify_result(verify_ms, nbytes, copy_bw, copy_ms, violations)

    fixed = fixed_grid_layer()
    fixed_rt = kv_canary.runtime_for(fixed)
    before = int(w.ctx.violation_write_index[0])
    fixed_ms = time_ms(lambda: w.verify(fixed_rt), repeats=repeats)
    torch.cuda.synchronize()
    out["verify_fixed_grid_64x512"] = _verify_result(fixed_ms, nbytes, copy_bw, copy_ms,
                                                     int(w.ctx.violation_write_index[0]) - before)

    # Write: one 32,768-token prefill chain (its own plan: 1 request, offsets [0, n]).
    alloc = importlib.import_module(layer.__name__ + ".allocators")
    one = alloc.WritePlan.allocate(write_req_capacity=1, device="cuda")
    one.write_offsets.copy_(torch.tensor([0, PREFILL_TOKENS]))
    one.write_seed_slot_indices.fill_(-1)
    one.write_num_valid_reqs.fill_(1)
    loc = torch.arange(1, PREFILL_TOKENS + 1, dtype=torch.int64, device="cuda")
    ids = torch.randint(0, 50_000, (PREFILL_TOKENS,), device="cuda")
    pos = torch.arange(PREFILL_TOKENS, device="cuda")
    out["write_prefill_32768_ms"] = time_ms(lambda: w.write(input_ids=ids, positions=pos, out_cache_loc=loc, plan=one),
                                            repeats=max(3, repeats // 4))
    # 256 one-token decodes, each seeded by its request's last prefix slot (the steady-state plan).
    dec = alloc.WritePlan.allocate(write_req_capacity=DECODES, device="cuda")
    dec.write_offsets.copy_(torch.arange(DECODES + 1))
    dec.write_seed_slot_indices.copy_(w.req_to_token[1:, -1].to(torch.int64))
    dec.write_num_valid_reqs.fill_(DECODES)
    dloc = w.req_to_token[1:, -1].to(torch.int64)  # rewrite the last slot (keeps the buffer valid size-wise)
    dids = torch.randint(0, 50_000, (DECODES,), device="cuda")
    dpos = torch.full((DECODES,), PLAN_PREFIX, device="cuda")
    out["write_decode_256_ms"] = time_ms(lambda: w.write(input_ids=dids, positions=dpos, out_cache_loc=dloc, plan=dec),
                                         repeats=repeats)
    out["plan_256x4096_ms"] = time_ms(lambda: w.plan(prefix=PLAN_PREFIX, extend=1), repeats=repeats)
    return out


def _verify_result(ms: float, nbytes: int, copy_bw: float, copy_ms: float, violations: int) -> dict:
    bps = nbytes / (ms * 1e-3)
    return {"ms": ms, "entries_per_s": ENTRIES / (ms * 1e-3), "bytes_per_s": bps,
            "ratio_vs_copy_bandwidth": bps / copy_bw, "copy_same_bytes_time_ratio": copy_ms / ms,
            "violations_found": violations}


def report(r: dict) -> str:
    lines = [f"device: {r['device']}; verify grid {r['verify_grid']}",
             f"copy {r['copy']['bytes'] / 1e6:.0f} MB: {r['copy']['ms']:.3f} ms, "
             f"{r['copy']['bandwidth_read_plus_write_Bps'] / 1e12:.2f} TB/s (read + write)"]
    for key in ("verify_persistent", "verify_fixed_grid_64x512"):
        v = r[key]
        lines.append(f"{key}: {v['ms']:.3f} ms, {v['entries_per_s'] / 1e9:.2f} G entries/s, "
                     f"{v['bytes_per_s'] / 1e12:.2f} TB/s read, {100 * v['ratio_vs_copy_bandwidth']:.0f}% of copy "
                     f"bandwidth (target 60%), violations {v['violations_found']}")
    lines.append(f"write: 32,768-token prefill {r['write_prefill_32768_ms']:.3f} ms; "
                 f"256 one-token decodes {r['write_decode_256_ms']:.3f} ms")
    lines.append(f"plan: 256 requests x 4,096 prefix tokens {r['plan_256x4096_ms']:.3f} ms")
    return "\n".join(lines)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--repeats", type=int, default=20)
    args = parser.parse_args(argv)
    if not gpu_available():
        print("bench_gpu: skipped (no CUDA device visible to CuPy and torch)")
        return 0
    results = bench(args.repeats)
    print(report(results))
    if args.json:
        args.json.write_text(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
