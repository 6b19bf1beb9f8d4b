"""The generated torch reference against the scalar oracle over random batches.

Cases per kernel: 100 on the default schema and 30 on each example schema, times the
KV_CANARY_CASES multiplier (tests/support/budget.py; `make test-full`: 4x). Hypothesis draws the seeds
(derandomized, so CI is stable).
"""
from __future__ import annotations

import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support import budget, scenarios
from support.oracle import Oracle

import kv_canary

LAUNCH = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
          "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}


def cases_for(tree) -> int:
    return budget.cases(100 if tree is kv_canary.generated else 30)


def run_both(tree, kind: str, case: dict) -> tuple[dict, dict]:
    """Run the reference (through the public runtime) and the oracle on copies of one case."""
    ref_case, oracle_case = scenarios.clone_case(case), scenarios.clone_case(case)
    getattr(scenarios.runtime_for(tree), LAUNCH[kind])(**ref_case, backend="torch")
    getattr(Oracle(tree), kind)(**oracle_case)
    return ref_case, oracle_case


def differential(tree, kind: str, make):
    @settings(max_examples=cases_for(tree), derandomize=True, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    # A seed per case, not st.randoms(): hypothesis instruments every call of its Random, which cost
    # more than the reference and the oracle together; a failure names its seed.
    @given(seed=st.integers(0, 2**64 - 1))
    def check(seed):
        case = make(random.Random(seed), tree)
        ref_case, oracle_case = run_both(tree, kind, case)
        scenarios.compare_state(ref_case, oracle_case)

    check()


def test_write_matches_oracle(any_tree):
    differential(any_tree, "write",
                 lambda rng, tree: scenarios.make_write_case(rng, tree, overlap=rng.random() < 0.5))


def test_verify_matches_oracle(any_tree):
    differential(any_tree, "verify", scenarios.make_verify_case)


def test_plan_matches_oracle(any_tree):
    tally = scenarios.PlanCaseTally()
    differential(any_tree, "plan", tally.make)
    tally.report(f"reference vs oracle ({any_tree.__name__})")


def test_scatter_matches_oracle(any_tree):
    differential(any_tree, "scatter", scenarios.make_scatter_case)


@pytest.mark.parametrize("kind", ["write", "verify"])
def test_cases_exercise_rows_and_ring_overflow(default_tree, kind):
    """The generator really produces violations, dropped rows and skipped entries (the suite can fail)."""
    make = getattr(scenarios, f"make_{kind}_case")
    bits, overflowed = 0, False
    for seed in range(120):
        ref_case, _ = run_both(default_tree, kind, make(random.Random(seed), default_tree))
        ctx = ref_case["context"]
        stored = min(int(ctx.violation_write_index[0]), ctx.violation_ring.shape[0])
        overflowed |= int(ctx.violation_write_index[0]) > ctx.violation_ring.shape[0]
        for row in ctx.violation_ring[:stored].tolist():
            bits |= row[default_tree.layout.VIOLATION_COL_FAIL_REASON]
    fr = default_tree.layout.FailReason
    want = {"write": fr.WRITE_TOKEN_MISMATCH | fr.WRITE_POSITION_MISMATCH | fr.SLOT_OUT_OF_RANGE,
            "verify": fr.VERIFY_CHAIN_HASH_MISMATCH | fr.VERIFY_POSITION_MISMATCH | fr.VERIFY_REAL_KV_HASH_MISMATCH
            | fr.VERIFY_TOKEN_MISMATCH | fr.SLOT_OUT_OF_RANGE}[kind]
    assert bits & want == want, f"bits seen {fr(bits & want)!r}, want {fr(want)!r}"
    assert overflowed
