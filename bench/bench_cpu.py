"""The native cpu backend at memory speed (run with `make bench`; issue 31).

For write and verify, in the real-KV hash modes ALL and PARTIAL, over 65,536 entries with 2 real-KV
sources of 256-byte rows read 128 bytes each (the measurement of issue 31): the bytes each launch
touches per second (what it reads and writes of the plan arrays, the inputs, the canary records and
the K/V rows, counted from the layout), as a fraction of a plain torch copy's bandwidth (bytes read
+ bytes written per second of `dst.copy_(src)` over 256 MiB) measured in the same run with the
same number of threads, before and after the tables (the faster kept); at 1 thread and at every
core this process may use, with the speed-up; the torch reference (one thread) beside it. Launches
are bound once (Runtime.bind) and run again and again; each figure is the best of --repeats runs and
of as many more as fit in 0.3 s (a shared machine: the least disturbed run; the copies are sampled
the same way). The cpu backend's result is checked against the reference's before anything is
timed. A closing note says what PARTIAL's reads move in whole 64-byte lines (the table's counting
stays the bytes the launch must read and write).
Beside the plain copy, a copy of the same part of each K/V row the launches read (128 and 16 bytes of
each 256-byte row): what a plain copy reaches on that access pattern, as a fraction of its rate on
whole rows (the 16-byte copy pays a per-row cost too, not only its lines).

Slots: the write stores 32 requests x 2,048 tokens and the verify walks one chain of 65,536 entries,
first at the pool's slots in order (a fresh pool, or pages of consecutive slots: rows stream), then at
a random permutation of them (a long-running engine's fragmented free list: every record and K/V row
is a cache and TLB miss); `--slots` picks one.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from support import scenarios  # noqa: E402

import kv_canary  # noqa: E402
from kv_canary.backends.cpu import default_threads  # noqa: E402

TREE = kv_canary.generated
L = TREE.layout
ALLOC = kv_canary.allocators
RT = scenarios.runtime_for(TREE)
ENTRIES = 65_536
SOURCES, ROW_BYTES, READ_BYTES = 2, 256, 128
REQUESTS = 32
COPY_BYTES = 256 << 20


def kv_bytes(mode: str) -> int:
    """K/V bytes one entry reads."""
    return SOURCES * (READ_BYTES if mode == "ALL" else int(L.REAL_KV_PARTIAL_READ_BYTES))


LINE = 64  # bytes of a cache line


def lines_note() -> str:
    """What PARTIAL's K/V reads move, against what the table counts (the counting is unchanged)."""
    counted = {name: per("PARTIAL") for name, per in (("verify", verify_bytes), ("write", write_bytes))}
    moved = {name: n - kv_bytes("PARTIAL") + SOURCES * LINE for name, n in counted.items()}
    return ", ".join(f"{name} {counted[name]} B per entry counted, {moved[name]} B with whole K/V lines" for name in counted)


def verify_bytes(mode: str) -> int:
    """Per entry: slot, expected position, prev slot; the slot's record; the prev's chain words; K/V."""
    chain_words = 1 + len(L.CANARY_CHAIN_FOLD_WORDS)
    return 3 * 8 + int(L.CANARY_RECORD_BYTES) + 8 * chain_words + kv_bytes(mode)


def write_bytes(mode: str) -> int:
    """Per entry: token, position, slot; the record (every word of the default schema is stored); K/V."""
    return 3 * 8 + int(L.CANARY_RECORD_BYTES) + kv_bytes(mode)


def context(num_slots: int, mode: str):
    sources = tuple(ALLOC.RealKvSource(tensor=torch.randint(0, 256, (num_slots, ROW_BYTES), dtype=torch.uint8),
                                       page_size=1, num_bytes_per_token=ROW_BYTES, read_bytes=READ_BYTES)
                    for _ in range(SOURCES))
    return ALLOC.allocate_context(num_slots=num_slots, ring_capacity=1024, device="cpu", real_kv_sources=sources,
                                  real_kv_hash_mode=getattr(L.RealKvHashMode, mode))


def slot_order(n: int, how: str) -> torch.Tensor:
    return (torch.randperm(n) if how == "random" else torch.arange(n)) + 1


def write_case(mode: str, how: str) -> dict:
    num_slots = ENTRIES + 1
    per = ENTRIES // REQUESTS
    plan = ALLOC.WritePlan.allocate(write_req_capacity=REQUESTS, device="cpu")
    plan.write_offsets.copy_(torch.arange(REQUESTS + 1) * per)
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(REQUESTS)
    return dict(context=context(num_slots, mode), plan=plan, input_ids=torch.randint(0, 50_000, (ENTRIES,)),
                positions=torch.arange(per).repeat(REQUESTS), out_cache_loc=slot_order(ENTRIES, how),
                enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)


def verify_case(mode: str, how: str) -> dict:
    """One chain of ENTRIES written by the cpu backend, verified entry by entry (no violation)."""
    num_slots = ENTRIES + 1
    ctx = context(num_slots, mode)
    slots = slot_order(ENTRIES, how)
    plan = ALLOC.WritePlan.allocate(write_req_capacity=1, device="cpu")
    plan.write_offsets[1] = ENTRIES
    plan.write_seed_slot_indices.fill_(-1)
    plan.write_num_valid_reqs.fill_(1)
    RT.launch_canary_write_kernel(context=ctx, plan=plan, input_ids=torch.randint(0, 50_000, (ENTRIES,)),
                                  positions=torch.arange(ENTRIES), out_cache_loc=slots, enable_write_input_assert=False,
                                  expected_input_tokens=None, expected_input_positions=None, backend="cpu")
    vplan = ALLOC.VerifyPlan.allocate(verify_capacity=ENTRIES, device="cpu")
    vplan.verify_slot_indices.copy_(slots)
    vplan.verify_prev_slot_indices[0] = -1
    vplan.verify_prev_slot_indices[1:] = slots[:-1]
    vplan.verify_expected_positions.copy_(torch.arange(ENTRIES))
    vplan.verify_num_valid.fill_(ENTRIES)
    return dict(context=ctx, plan=vplan, check_verify_expected_token=False)


SPAN = 0.3  # seconds each figure is sampled for at least (a quiet spell of the shared machine is short)


def best(fn, repeats: int, span: float = SPAN) -> float:
    """The fastest of `repeats` runs of fn, and of more while `span` seconds have not passed."""
    fn()  # warm-up (first touch, caches)
    times = []
    end = time.perf_counter() + span
    while len(times) < repeats or time.perf_counter() < end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def copy_bandwidth(threads: int, repeats: int) -> float:
    """Bytes read + written per second by dst.copy_(src) on `threads` torch threads."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randint(0, 256, (COPY_BYTES,), dtype=torch.uint8)
        dst = torch.empty_like(src)
        return 2 * COPY_BYTES / best(lambda: dst.copy_(src), repeats)
    finally:
        torch.set_num_threads(saved)


def row_copy_bandwidth(threads: int, width: int, repeats: int) -> float:
    """Bytes read + written per second by a torch copy of the first `width` bytes of each ROW_BYTES row
    (256 MiB of rows): the K/V reads' access pattern, which memory serves in whole lines and the
    prefetchers read past."""
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        src = torch.randint(0, 256, (COPY_BYTES // ROW_BYTES, ROW_BYTES), dtype=torch.uint8)
        dst = torch.empty((src.shape[0], width), dtype=torch.uint8)
        return 2 * dst.numel() / best(lambda: dst.copy_(src[:, :width]), repeats)
    finally:
        torch.set_num_threads(saved)


def check_equal(launch: str, case: dict) -> None:
    ref, got = scenarios.clone_case(case), scenarios.clone_case(case)
    getattr(RT, launch)(**ref, backend="torch")
    getattr(RT, launch)(**got, backend="cpu")
    scenarios.compare_state(ref, got)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--slots", choices=("sequential", "random", "both"), default="both")
    args = ap.parse_args()
    torch.manual_seed(0)
    cpu = RT.backend("cpu")
    saved = cpu.threads, cpu.grain
    cores = default_threads()
    counts = sorted({1, cores})
    copy = {n: copy_bandwidth(n, args.repeats) for n in counts}
    kv_copy = {mode: {n: row_copy_bandwidth(n, kv_bytes(mode) // SOURCES, args.repeats) for n in counts}
               for mode in ("ALL", "PARTIAL")}
    torch.set_num_threads(1)
    try:
        tables = {how: table(how, counts, cpu, args.repeats)
                  for how in (("sequential", "random") if args.slots == "both" else (args.slots,))}
    finally:
        cpu.set_threads(*saved[:1], grain=saved[1])
    for n in counts:  # measured again after the tables: the least disturbed of the two is the yardstick
        copy[n] = max(copy[n], copy_bandwidth(n, args.repeats))
    print(f"kv-canary cpu backend at memory speed: {ENTRIES:,} entries, {SOURCES} x {READ_BYTES} B real-KV sources; "
          f"torch {torch.__version__}, {os.cpu_count()} CPUs, {cores} usable")
    print("copy bandwidth (torch dst.copy_(src), 256 MiB, read + written; the faster of before and after the tables): "
          + ", ".join(f"{n} thread{'s' if n > 1 else ''} {copy[n] / 1e9:.1f} GB/s" for n in counts))
    for mode, rows in kv_copy.items():
        print(f"copy of {kv_bytes(mode) // SOURCES} B of each {ROW_BYTES} B row ({mode}'s K/V reads): "
              + ", ".join(f"{n} thread{'s' if n > 1 else ''} {rows[n] / 1e9:.1f} GB/s ({rows[n] / copy[n]:.0%})"
                          for n in counts))
    last = counts[-1]
    for how, rows in tables.items():
        print(f"{how + ' slots':<18} {'bytes':>9} {'torch ref (1 thr)':>19}" + "".join(f" {f'cpu {n} thr':>24}" for n in counts)
              + (f" {f'{last} thr/1':>8}" if last > 1 else ""))
        for label, nbytes, t_ref, times in rows:
            cells = "".join(f" {f'{times[n] * 1e3:6.2f} ms {nbytes / times[n] / 1e9:5.1f} GB/s {nbytes / times[n] / copy[n]:4.0%}':>24}"
                            for n in counts)
            print(f"{label:<18} {nbytes / 2**20:6.1f} MiB {t_ref * 1e3:8.2f} ms {nbytes / t_ref / 1e9:5.1f} GB/s" + cells
                  + (f" {times[1] / times[last]:7.2f}x" if last > 1 else ""))
    print("(each cpu cell: time, bytes touched per second, and that as a fraction of the copy bandwidth at the same "
          f"thread count; target: >= 50% on one thread; {last} thr/1: the speed-up on {last} threads)" if last > 1 else
          "(each cpu cell: time, bytes touched per second, and that as a fraction of the copy bandwidth; target: >= 50%)")
    print(f"(PARTIAL counts the {int(L.REAL_KV_PARTIAL_READ_BYTES)} B it reads of each source's row; the hardware "
          f"moves the whole {LINE} B line holding them: {lines_note()})")
    return 0


def table(how: str, counts: list, cpu, repeats: int) -> list:
    """(label, bytes, torch reference time, {threads: cpu time}) of write and verify in both modes."""
    rows = []
    for name, launch, make, per_entry in (("verify", "launch_canary_verify_kernel", verify_case, verify_bytes),
                                          ("write", "launch_canary_write_kernel", write_case, write_bytes)):
        for mode in ("ALL", "PARTIAL"):
            case = make(mode, how)
            check_equal(launch, case)
            ref = RT.bind(launch, **scenarios.clone_case(case), backend="torch")
            t_ref = best(ref.run, max(2, repeats // 3), span=0)
            times = {}
            for n in counts:
                cpu.set_threads(n)
                times[n] = best(RT.bind(launch, **case, backend="cpu").run, repeats)
            rows.append((f"{name} {mode}", per_entry(mode) * ENTRIES, t_ref, times))
    return rows


if __name__ == "__main__":
    sys.exit(main())
