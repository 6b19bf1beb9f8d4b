"""[extension] Per-reason violation totals: `violation_reason_counts` counts every row a
launch produces, in the column of each FailReason bit, also the rows dropped past the ring's
capacity. Checked on every host backend; the random differential suites compare the counts too.
"""
from __future__ import annotations

import dataclasses
import os
import random
import shutil

import pytest
import torch
from support import scenarios
from support.kernel_diff import run

_NEEDS_GXX = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
BACKENDS = ["torch", pytest.param("cpu", marks=_NEEDS_GXX), pytest.param("emulated", marks=_NEEDS_GXX)]
SEEDS = int(os.environ.get("KV_CANARY_REASON_COUNT_SEEDS", "40"))


def _alloc(tree):
    return tree.allocators


def _reason_bits(tree) -> list[int]:
    """Column i = FailReason member i in declaration order (derived from the enum, not the table)."""
    return [int(m) for m in tree.layout.FailReason]


def _tally(tree, rows) -> list[int]:
    col = tree.layout.VIOLATION_COL_FAIL_REASON
    return [sum(1 for r in rows if r[col] & bit) for bit in _reason_bits(tree)]


def test_layout_and_allocation(any_tree):
    lay, alloc = any_tree.layout, _alloc(any_tree)
    assert list(lay.VIOLATION_REASON_COUNT_BITS) == _reason_bits(any_tree)
    assert list(lay.VIOLATION_REASON_COUNT_NAMES) == [m.name for m in lay.FailReason]
    counts = alloc.allocate_reason_counts(device="cpu")
    assert counts.dtype == torch.int64 and counts.tolist() == [0] * len(lay.FailReason)
    ctx = alloc.allocate_context(num_slots=4, ring_capacity=2, device="cpu")
    assert ctx.violation_reason_counts.tolist() == [0] * len(lay.FailReason)
    assert alloc.allocate_context(num_slots=4, ring_capacity=2, device="cpu", count_reasons=False) \
        .violation_reason_counts is None


def _oor_verify(tree, *, ring_capacity: int, n: int, counts: bool = True):
    """n verify entries whose slot lies past the buffer: n SLOT_OUT_OF_RANGE rows (docs/semantics.md §8)."""
    alloc = _alloc(tree)
    ctx = alloc.allocate_context(num_slots=8, ring_capacity=ring_capacity, device="cpu", count_reasons=counts)
    plan = alloc.VerifyPlan.allocate(verify_capacity=n, device="cpu")
    plan.verify_slot_indices.copy_(torch.arange(100, 100 + n))
    plan.verify_prev_slot_indices.fill_(-1)
    plan.verify_num_valid.fill_(n)
    return dict(context=ctx, plan=plan, check_verify_expected_token=False, extra_slot_tables={})


@pytest.mark.parametrize("backend", BACKENDS)
def test_rows_past_capacity_still_count(default_tree, backend):
    lay = default_tree.layout
    oor = list(lay.FailReason).index(lay.FailReason.SLOT_OUT_OF_RANGE)
    for cap in (0, 2, 5):
        case = run(default_tree, "verify", _oor_verify(default_tree, ring_capacity=cap, n=5), backend)
        want = [0] * len(lay.FailReason)
        want[oor] = 5
        assert case["context"].violation_write_index.tolist() == [5]
        assert case["context"].violation_reason_counts.tolist() == want
        # Totals accumulate across launches sharing the tensor (never reset by a kernel).
        run(default_tree, "verify", case, backend)
        want[oor] = 10
        assert case["context"].violation_reason_counts.tolist() == want


@pytest.mark.parametrize("backend", BACKENDS)
def test_counts_equal_the_bits_of_every_row(default_tree, backend):
    """Random write and verify cases with small rings: the counts grow by the per-bit tallies of all
    the rows the launch produces, which a ring big enough to keep them shows."""
    seen_overflow = seen_bits = 0
    # At least SEEDS cases, and on until both a row and a ring overflow have been seen (bounded).
    for seed in range(20 * SEEDS):
        if seed >= SEEDS and seen_overflow and seen_bits:
            break
        kind = ("write", "verify")[seed % 2]
        make = getattr(scenarios, f"make_{kind}_case")
        case = make(random.Random(seed), default_tree)
        ctx = case["context"]
        if ctx.violation_reason_counts is None:
            continue
        before = ctx.violation_reason_counts.tolist()
        start = int(ctx.violation_write_index[0])
        got = run(default_tree, kind, scenarios.clone_case(case), backend)["context"]
        end = int(got.violation_write_index[0])
        big = scenarios.clone_case(case)
        room = torch.zeros((max(start, 0) + end - start, ctx.violation_ring.shape[1]), dtype=torch.int64)
        big["context"] = dataclasses.replace(big["context"], violation_ring=room)
        rows = run(default_tree, kind, big, "torch")["context"].violation_ring[max(start, 0):].tolist()
        assert len(rows) == end - start
        assert got.violation_reason_counts.tolist() == [b + t for b, t in zip(before, _tally(default_tree, rows))], \
            f"{kind} seed {seed}"
        seen_overflow += end > ctx.violation_ring.shape[0] > start
        seen_bits += any(rows)
    assert seen_overflow and seen_bits, "the cases must produce rows and overflow the ring"


@pytest.mark.parametrize("backend", BACKENDS)
def test_no_counts_changes_nothing_else(default_tree, backend):
    """Without the tensor (SGLang-style context) the launch is the same, byte for byte."""
    with_counts = run(default_tree, "verify", _oor_verify(default_tree, ring_capacity=3, n=4), backend)
    without = run(default_tree, "verify", _oor_verify(default_tree, ring_capacity=3, n=4, counts=False), backend)
    assert without["context"].violation_reason_counts is None
    with_counts["context"] = dataclasses.replace(with_counts["context"], violation_reason_counts=None)
    scenarios.compare_state(with_counts, without)


@pytest.mark.parametrize("make_bad, error, match", [
    (lambda n: torch.zeros(n, dtype=torch.int32), TypeError,
     "violation_reason_counts must have dtype torch.int64, got torch.int32"),
    (lambda n: torch.zeros(n + 1, dtype=torch.int64), ValueError,
     r"violation_reason_counts must have shape \({n},\), got \({n1},\)"),
    (lambda n: torch.zeros((n, 1), dtype=torch.int64), ValueError,
     r"violation_reason_counts must be 1-D, got shape \({n}, 1\)"),
    (lambda n: torch.zeros(2 * n, dtype=torch.int64)[::2], ValueError, "violation_reason_counts must be contiguous"),
    (lambda n: torch.zeros(n, dtype=torch.int64, device="meta"), ValueError,
     r"violation_reason_counts must be on cpu \(the device of canary_buf\), got meta"),
])
def test_bad_counts_are_rejected_before_launch(default_tree, make_bad, error, match):
    n = len(default_tree.layout.FailReason)
    case = _oor_verify(default_tree, ring_capacity=2, n=2)
    case["context"] = dataclasses.replace(case["context"], violation_reason_counts=make_bad(n))
    with pytest.raises(error, match="^kv-canary: " + match.format(n=n, n1=n + 1) + "$"):
        scenarios.runtime_for(default_tree).launch_canary_verify_kernel(**case, backend="torch")
    assert case["context"].violation_write_index.tolist() == [0]  # nothing ran
