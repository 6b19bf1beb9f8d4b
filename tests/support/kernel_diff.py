"""Differential harness shared by the emulated and GPU suites: run one scenario (tests/support/scenarios.py)
through the torch reference and through a kernel backend, and compare the end states.

Buffers, plans, write indices and counters must be equal exactly, and so are the rings of the host
backends, which append in entry order (the emulated verify launcher re-stores a launch's rows by
entry). Violation rings are compared as multisets when the backend appends in parallel (GPU,
`ordered=False`). When such a ring overflows,
which rows land below the capacity depends on the order, so the rows the backend stored must be a
sub-multiset of the rows the reference produces with a ring large enough to keep them all. The
per-reason totals (violation_reason_counts) count dropped rows too and do not depend on the order,
so they must be equal exactly in every case.
"""
from __future__ import annotations

import dataclasses
from collections import Counter

import torch

from support import scenarios

LAUNCH = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
          "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}


def run(tree, kind: str, case: dict, backend: str) -> dict:
    getattr(scenarios.runtime_for(tree), LAUNCH[kind])(**case, backend=backend)
    return case


def run_plan_stages(tree, case: dict, scratch, backend: str) -> dict:
    """launch_plan_offsets_kernel then launch_plan_entries_kernel on a plan case, with `scratch`."""
    rt = scenarios.runtime_for(tree)
    offsets, entries = scenarios.plan_stages(tree, case, scratch)
    rt.launch_plan_offsets_kernel(**offsets, backend=backend)
    rt.launch_plan_entries_kernel(**entries, backend=backend)
    return case


def _with_big_ring(case: dict) -> dict:
    """A copy of `case` whose ring keeps every row (the old rows first, then room for all new ones)."""
    big = scenarios.clone_case(case)
    ctx = big["context"]
    start = int(ctx.violation_write_index[0])
    room = 4 * (_entries(big) + 4) + 16
    ring = torch.zeros((max(start, 0) + room, ctx.violation_ring.shape[1]), dtype=ctx.violation_ring.dtype,
                       device=ctx.violation_ring.device)
    keep = min(ctx.violation_ring.shape[0], ring.shape[0])
    ring[:keep] = ctx.violation_ring[:keep]
    big["context"] = dataclasses.replace(ctx, violation_ring=ring)
    return big


def _entries(case: dict) -> int:
    if "out_cache_loc" in case:
        return int(case["out_cache_loc"].shape[0]) + int(case["plan"].write_seed_slot_indices.shape[0])
    return int(case["plan"].verify_slot_indices.shape[0])


def compare(tree, kind: str, case: dict, backend: str, *, ordered: bool) -> None:
    """Run `case` on the reference and on `backend` and assert the same end state."""
    ref = run(tree, kind, scenarios.clone_case(case), "torch")
    got_case = scenarios.clone_case(case)
    if backend == "cuda":
        got_case = scenarios.case_to(got_case, "cuda")
    got = scenarios.case_to(run(tree, kind, got_case, backend), "cpu")
    if "context" not in case or ordered:
        scenarios.compare_state(ref, got)
        return
    ref_ctx, got_ctx = ref["context"], got["context"]
    cap = ref_ctx.violation_ring.shape[0]
    start = int(case["context"].violation_write_index[0])
    end = int(ref_ctx.violation_write_index[0])
    assert int(got_ctx.violation_write_index[0]) == end, "violation_write_index differs"
    if end <= cap or start >= cap:   # every new row stored (or none): same multiset
        scenarios.compare_state(ref, got, ring_as_multiset=True)
        return
    full = run(tree, kind, _with_big_ring(case), "torch")["context"].violation_ring
    new_ref = Counter(map(tuple, full[max(start, 0):end].tolist()))
    new_got = Counter(map(tuple, got_ctx.violation_ring[max(start, 0):cap].tolist()))
    assert not new_got - new_ref, f"rows stored that the reference never produces: {new_got - new_ref}"
    assert torch.equal(got_ctx.violation_ring[:max(start, 0)], ref_ctx.violation_ring[:max(start, 0)])
    got["context"] = dataclasses.replace(got_ctx, violation_ring=ref_ctx.violation_ring)
    scenarios.compare_state(ref, got)
