"""The native cpu backend (the schema's kernels compiled for the host, kv_canary/csrc/kvc_cpu.h)
against the torch reference over the random scenarios of tests/support/scenarios.py.

As many cases as the emulated suite (80 per kernel on the default schema, 20 on each example
schema, times KV_CANARY_CASES) as a default launch runs them (the scenarios' small launches stay
on one thread), and a quarter of them split over three threads of one entry or more each (grain 1), so
that the parallel paths (verify's private rings appended in entry order, the write's precomputed
fingerprints and its shares of stores, the plan entries' ranges) see every case too. Rings are
compared exactly: the cpu backend appends in entry order, and write rows in request order. Seeds
are fixed (seed i = case i).
"""
from __future__ import annotations

import random
import shutil

import pytest
from support import budget, scenarios
from support.kernel_diff import compare, run_plan_stages

import kv_canary

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

SPLITS = {"default": None, "split": (3, 1)}  # (threads, grain) of the second run


def cases_for(tree, split: str) -> int:
    base = 80 if tree is kv_canary.generated else 20
    return budget.cases(base if split == "default" else base // 4)  # the split run: a quarter of them


@pytest.fixture(params=list(SPLITS))
def split(request, any_tree):
    backend = kv_canary.runtime_for(any_tree).backend("cpu")   # built once, outside the per-case loop
    threads, grain = backend.threads, backend.grain
    if SPLITS[request.param] is not None:
        backend.set_threads(SPLITS[request.param][0], grain=SPLITS[request.param][1])
    yield request.param
    backend.set_threads(threads, grain=grain)


def each_case(tree, kind: str, make, split: str) -> None:
    for seed in range(cases_for(tree, split)):
        case = make(random.Random(seed), tree)
        try:
            compare(tree, kind, case, "cpu", ordered=True)
        except AssertionError as exc:
            raise AssertionError(f"{kind} case seed={seed} ({tree.__name__}): {exc}") from None


def test_write_matches_reference(any_tree, split):
    # Duplicate slots and in-batch seeds (overlap cases) want request order: the stores of a split run
    # go by shares of the requests (a slot two shares store: all again on one thread), or the
    # requests are walked in order on one thread where a chain starts from the launch's own store.
    each_case(any_tree, "write",
              lambda rng, tree: scenarios.make_write_case(rng, tree, overlap=rng.random() < 0.5), split)


def test_verify_matches_reference(any_tree, split):
    each_case(any_tree, "verify", scenarios.make_verify_case, split)


def test_plan_matches_reference(any_tree, split):
    tally = scenarios.PlanCaseTally()
    each_case(any_tree, "plan", tally.make, split)
    tally.report(f"cpu vs reference ({any_tree.__name__}, {split})")


def test_plan_stages_match_reference(any_tree, split):
    """launch_plan_offsets_kernel then launch_plan_entries_kernel, as SGLang calls them one by one."""
    for seed in range(cases_for(any_tree, split)):
        case = scenarios.make_plan_case(random.Random(seed), any_tree)
        bs = int(case["req_pool_indices"].shape[0])
        ref = run_plan_stages(any_tree, scenarios.clone_case(case), case["req_pool_indices"].new_zeros(bs + 1), "torch")
        got = run_plan_stages(any_tree, scenarios.clone_case(case), case["req_pool_indices"].new_zeros(bs + 1), "cpu")
        scenarios.compare_state(ref, got)


def test_scatter_matches_reference(any_tree, split):
    each_case(any_tree, "scatter", scenarios.make_scatter_case, split)
