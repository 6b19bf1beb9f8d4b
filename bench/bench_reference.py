"""Torch reference vs the scalar oracle on issue 3 §4's workloads (run with `make bench`).

Prints entries/s of both and their ratio against the targets (verify >= 100x, write >= 20x,
plan >= 50x), after checking that both produced identical state; `--strict` exits 1 on a miss.
The reference's time is the best of 5 runs, each on a fresh copy of the inputs; the oracle runs once.
KV_CANARY_BENCH_THREADS sets torch's intra-op threads (default 1). Also times the write's serial
chain three ways: the reference's lock-step over requests packed into one Python int (128-bit lanes),
a plain-int loop per request (the previous reference) and a numpy-vector lock-step.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import kv_canary  # noqa: E402
from kv_canary.backends import reference as chains  # noqa: E402
from tests.support import scenarios  # noqa: E402
from tests.support.oracle import Oracle  # noqa: E402

TREE = kv_canary.generated
ALLOC = kv_canary.allocators
RT = scenarios.runtime_for(TREE)
# One intra-op thread by default: the reference's tensors are small enough that OpenMP fan-out
# costs more than it gains, and on a shared 2-core machine spinning threads collapse throughput.
torch.set_num_threads(int(os.environ.get("KV_CANARY_BENCH_THREADS", "1")))


def sources(num_slots: int, n: int = 2, read: int = 128):
    out = []
    for _ in range(n):
        t = torch.randint(0, 256, (num_slots, 256), dtype=torch.uint8)
        out.append(ALLOC.RealKvSource(tensor=t, page_size=1, num_bytes_per_token=256, read_bytes=read))
    return tuple(out)


def context(num_slots: int):
    return ALLOC.allocate_context(num_slots=num_slots, ring_capacity=1024, device="cpu", real_kv_sources=sources(num_slots),
                                  real_kv_hash_mode=TREE.layout.RealKvHashMode.ALL)


def timed(fn, repeat: int = 1, prepare=lambda: None) -> float:
    """Best wall time of fn(prepare()) over `repeat` runs; preparation is not timed."""
    best = float("inf")
    for _ in range(repeat):
        arg = prepare()
        t0 = time.perf_counter()
        fn(arg)
        best = min(best, time.perf_counter() - t0)
    return best


def write_case(lengths, seeds, num_slots, ctx):
    total = sum(lengths)
    slots = torch.randperm(num_slots - 1)[:total] + 1
    positions = torch.cat([torch.arange(n) + (5 if s >= 0 else 0) for n, s in zip(lengths, seeds)])
    plan = ALLOC.WritePlan.allocate(write_req_capacity=len(lengths), device="cpu")
    plan.write_offsets[1:] = torch.tensor(lengths).cumsum(0)
    plan.write_seed_slot_indices.copy_(torch.tensor(seeds))
    plan.write_num_valid_reqs.fill_(len(lengths))
    return dict(context=ctx, plan=plan, input_ids=torch.randint(0, 50_000, (total,)), positions=positions,
                out_cache_loc=slots, enable_write_input_assert=False, expected_input_tokens=None,
                expected_input_positions=None, extra_inputs={})


def verify_case(n: int):
    num_slots = n + 1
    ctx = context(num_slots)
    # One long chain written by the reference, then verified entry by entry.
    RT.launch_canary_write_kernel(**write_case([n], [-1], num_slots, ctx))
    order = ctx.canary_buf.view(torch.int64)[:, TREE.layout.CANARY_POSITION_WORD]
    slots = torch.argsort(order[1:]) + 1
    plan = ALLOC.VerifyPlan.allocate(verify_capacity=n, device="cpu")
    plan.verify_slot_indices.copy_(slots)
    plan.verify_prev_slot_indices[0] = -1
    plan.verify_prev_slot_indices[1:] = slots[:-1]
    plan.verify_expected_positions.copy_(torch.arange(n))
    plan.verify_num_valid.fill_(n)
    return dict(context=ctx, plan=plan, check_verify_expected_token=False, extra_slot_tables={})


def plan_case(bs: int, prefix: int):
    rows = bs + 1
    r2t = torch.randint(1, 1 << 20, (rows, prefix + 1), dtype=torch.int32)
    cap = bs * prefix
    return dict(verify_plan_out=ALLOC.VerifyPlan.allocate(verify_capacity=cap, device="cpu"),
                write_plan_out=ALLOC.WritePlan.allocate(write_req_capacity=bs, device="cpu"),
                req_pool_indices=torch.arange(1, bs + 1), prefix_lens=torch.full((bs,), prefix),
                extend_seq_lens=torch.ones(bs, dtype=torch.int64), req_to_token=r2t, swa_window_size=0,
                full_to_swa_index_mapping=None, verify_capacity=cap,
                req_to_verify_expected_tokens=torch.randint(0, 50_000, (rows, prefix + 1), dtype=torch.int32),
                req_to_verify_expected_tokens_valid_lens=torch.full((bs,), prefix), kv_token_id_vs_position_offset=0,
                extra_request_values={})


def compare(name: str, entries: int, case: dict, launch: str, oracle_fn, target: float) -> bool:
    ref_case, oracle_case = scenarios.clone_case(case), scenarios.clone_case(case)
    t_ref = timed(lambda c: getattr(RT, launch)(**c), repeat=5, prepare=lambda: scenarios.clone_case(case))
    getattr(RT, launch)(**ref_case)
    t_oracle = timed(lambda _: oracle_fn(**oracle_case))
    scenarios.compare_state(ref_case, oracle_case)
    ratio = t_oracle / t_ref
    ok = ratio >= target
    print(f"{name:<44} reference {entries / t_ref:>13,.0f} entries/s ({t_ref * 1e3:8.1f} ms)   "
          f"oracle {entries / t_oracle:>11,.0f} entries/s ({t_oracle * 1e3:8.1f} ms)   "
          f"ratio {ratio:7.1f}x (target {target:.0f}x) {'ok' if ok else 'MISSED'}")
    return ok


def int_loop_chains(lens, seeds, fold_values):
    """Alternative 1 (the previous reference): each request's chain in a plain-int loop, one request after another."""
    out, at = [], 0
    for n, seed in zip(lens.tolist(), seeds.tolist()):
        out += chains.serial_chain(seed, [v[at:at + n].tolist() for v in fold_values])
        at += n
    return np.array(out, dtype=np.uint64)


def vector_lockstep_chains(lens, seeds, fold_values):
    """Alternative 2: all requests advance in lock-step, one numpy vector step (over the live requests) per position."""
    firsts = np.cumsum(lens) - lens
    running = seeds.copy()
    out = np.zeros(int(lens.sum()), dtype=np.uint64)
    for step in range(int(lens.max()) if lens.size else 0):
        live = lens > step
        idx = firsts[live] + step
        out[idx] = running[live]
        running[live] = chains.link_values(running[live], [v[idx] for v in fold_values])
    return out


def chain_methods(lengths) -> None:
    """Times the write's serial chain alone: the reference's packed lock-step vs the two alternatives."""
    lens = np.array(lengths, dtype=np.int64)
    total = int(lens.sum())
    seeds = np.full(lens.size, TREE.layout.CANARY_CHAIN_HEAD, dtype=np.uint64)
    rng = np.random.default_rng(0)
    # One value array per chained field (fold order); tokens and positions are the realistic magnitudes.
    fold_values = [rng.integers(0, 50_000, total).astype(np.uint64) for _ in TREE.layout.CANARY_CHAIN_FOLD_WORDS]
    deps = np.full(lens.size, -1, dtype=np.int64)
    t_ref = timed(lambda _: chains.run_chains(lens, seeds, deps, fold_values), repeat=5)
    t_int = timed(lambda _: int_loop_chains(lens, seeds, fold_values), repeat=3)
    t_vec = timed(lambda _: vector_lockstep_chains(lens, seeds, fold_values), repeat=3)
    want = chains.run_chains(lens, seeds, deps, fold_values)
    assert np.array_equal(want, int_loop_chains(lens, seeds, fold_values))
    assert np.array_equal(want, vector_lockstep_chains(lens, seeds, fold_values))
    print(f"  write chain only, {lens.size} requests / {total} entries: packed lock-step (reference) {t_ref * 1e3:.1f} ms; "
          f"plain-int loop {t_int * 1e3:.1f} ms ({t_int / t_ref:.1f}x that), "
          f"numpy-vector lock-step {t_vec * 1e3:.1f} ms ({t_vec / t_ref:.1f}x that)")


def main() -> int:
    torch.manual_seed(0)
    oracle = Oracle(TREE)
    print(f"kv-canary torch reference vs scalar oracle (torch {torch.__version__}, {torch.get_num_threads()} threads)")
    ok = compare("verify 65,536 entries, ALL, 2 x 128 B", 65_536, verify_case(65_536),
                 "launch_canary_verify_kernel", oracle.verify, 100)
    lengths = [2048] * 8 + [1] * 256
    num_slots = sum(lengths) + 300
    ctx = context(num_slots)
    case = write_case(lengths, [-1] * 8 + list(range(sum(lengths) + 1, sum(lengths) + 257)), num_slots, ctx)
    ok &= compare("write 8 x 2,048 prefill + 256 decodes, ALL", sum(lengths), case,
                  "launch_canary_write_kernel", oracle.write, 20)
    chain_methods([2048] * 8)
    chain_methods([1] * 256)
    chain_methods([2048] * 8 + [1] * 256)
    chain_methods([16_384])
    ok &= compare("plan 256 requests x 1,024 prefix tokens", 256 * 1024, plan_case(256, 1024),
                  "launch_canary_plan_kernels", oracle.plan, 50)
    if not ok:
        print("some targets were missed" + (" (strict: failing)" if "--strict" in sys.argv else ""))
    return 1 if (not ok and "--strict" in sys.argv) else 0


if __name__ == "__main__":
    sys.exit(main())
