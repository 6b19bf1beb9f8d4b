"""How much of the randomized and compile-heavy work a test run does.

`make test` (the default) runs the per-suite case counts written in each suite's docstring and
compiles the example schemas for one architecture; `make test-full` sets
KV_CANARY_CASES=4 and KV_CANARY_FULL=1: four times the cases, every compiler on every
architecture for every schema, both optimisation levels of the emulation shim's self-test.
The GPU suites keep their own counts (scripts/gpu_check.py runs them on the device).
"""
from __future__ import annotations

import os

MULTIPLIER = float(os.environ.get("KV_CANARY_CASES", "1"))
FULL = os.environ.get("KV_CANARY_FULL") == "1"


def cases(base: int) -> int:
    """`base` cases scaled by KV_CANARY_CASES, never fewer than one."""
    return max(1, int(base * MULTIPLIER))
