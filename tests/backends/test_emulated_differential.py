"""The emulated backend (the generated CUDA sources compiled by g++, run on host fibers in strict
warp mode) against the torch reference over the random scenarios of tests/support/scenarios.py.

80 cases per kernel on the default schema, 20 on each example schema, times KV_CANARY_CASES
(tests/support/budget.py; `make test-full`: 4x).
Seeds are fixed (seed i = case i), so a failure names the seed that reproduces it.
"""
from __future__ import annotations

import random
import shutil

import pytest
from support import budget, scenarios
from support.kernel_diff import compare

import kv_canary

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

def cases_for(tree) -> int:
    return budget.cases(80 if tree is kv_canary.generated else 20)


def each_case(tree, kind: str, make, *, ordered: bool) -> None:
    kv_canary.runtime_for(tree).backend("emulated")   # build once, outside the per-case timing
    for seed in range(cases_for(tree)):
        case = make(random.Random(seed), tree)
        try:
            compare(tree, kind, case, "emulated", ordered=ordered)
        except AssertionError as exc:
            raise AssertionError(f"{kind} case seed={seed} ({tree.__name__}): {exc}") from None


def test_write_matches_reference(any_tree):
    # Each request's chain is walked in entry order by one thread, its rows are appended in entry
    # order (block_per_request: each stager thread appends its entry's rows before its warp's first
    # collective, and emulated threads run in index order), and emulated blocks run in request
    # order: rows land where the reference puts them, and the sequential semantics of duplicates
    # and in-batch seeds hold, so overlap cases are exact too.
    each_case(any_tree, "write",
              lambda rng, tree: scenarios.make_write_case(rng, tree, overlap=rng.random() < 0.5), ordered=True)


def test_verify_matches_reference(any_tree):
    # Host backends append verify rows in entry order (docs/semantics.md §5.2): the emulated launcher
    # re-stores a launch's rows sorted by entry, so rings (overflowing ones too) are exact.
    each_case(any_tree, "verify", scenarios.make_verify_case, ordered=True)


def test_plan_matches_reference(any_tree):
    tally = scenarios.PlanCaseTally()
    each_case(any_tree, "plan", tally.make, ordered=True)
    tally.report(f"emulated vs reference ({any_tree.__name__})")


def test_scatter_matches_reference(any_tree):
    each_case(any_tree, "scatter", scenarios.make_scatter_case, ordered=True)
