"""Fuzzing the generator front end with schema mutations (tests/support/schema_fuzz.py): every mutated
kernels.yaml gives either located one-line diagnostics or a tree whose Python compiles; never a
traceback, a hang or a blow-up.

`make test` runs a small, reproducible budget (derandomize=True: the same cases on every run and
machine). `make fuzz` runs a large one (KV_CANARY_FUZZ_EXAMPLES cases, default here 30) with a hang
watchdog, and builds every new clean tree (up to KV_CANARY_FUZZ_TREES, default 0 here) with g++
and NVRTC and runs it against the torch reference on the emulated backend; it prints the counts.
"""
from __future__ import annotations

import os
import shutil

import pytest
from hypothesis import HealthCheck, given, settings
from kv_canary.codegen.load import load_schema_text
from kv_canary.codegen.render import make_environment, render_all
from support.schema_fuzz import Stats, TreeChecker, build_and_run, check_case, mutated_schemas
from support.trees import DEFAULT_SCHEMA

EXAMPLES = int(os.environ.get("KV_CANARY_FUZZ_EXAMPLES", "30"))
TREES = int(os.environ.get("KV_CANARY_FUZZ_TREES", "0"))
LARGE = "KV_CANARY_FUZZ_EXAMPLES" in os.environ
# The watchdog is a hang detector for the large budget only (`make test` never depends on the clock):
# one case takes well under a second.
HANG_S = 120.0 if LARGE else 0.0


def test_every_mutated_schema_gives_diagnostics_or_a_tree(tmp_path):
    if TREES and shutil.which("g++") is None:
        pytest.skip("KV_CANARY_FUZZ_TREES needs g++ to build the trees")
    env = make_environment()  # compiled templates, shared by every case
    stats = Stats()
    trees = TreeChecker(tmp_path, TREES) if TREES else None

    @settings(max_examples=EXAMPLES, derandomize=True, database=None, deadline=None, print_blob=True,
              suppress_health_check=list(HealthCheck))
    @given(mutated_schemas())
    def one(case):
        check_case(case, env, stats, trees, hang_s=HANG_S)

    one()
    print("\n" + stats.summary())
    assert stats.hangs == 0, f"{stats.hangs} cases did not finish within {HANG_S}s: {stats.hang_cases[:5]}"
    assert stats.internal == 0
    assert not stats.tree_failures, "clean schemas whose tree fails:\n" + stats.failure_report()
    assert stats.tried >= EXAMPLES and stats.rejected > 0


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
def test_the_tree_check_of_make_fuzz_passes_the_default_schema(tmp_path):
    """`make fuzz` writes, imports, builds and runs every new clean tree (schema_fuzz.build_and_run);
    the small budget above builds none, so this keeps that path in step with the generated tree.
    (The default schema's kernels compile with NVRTC in tests/trees/test_nvrtc_compile.py already.)"""
    text = DEFAULT_SCHEMA.read_text(encoding="utf-8")
    files = render_all(load_schema_text(text, "kernels.yaml"), text, make_environment())
    build_and_run(tmp_path / "tree", files, seeds=1, nvrtc_compile=False)


@pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
@pytest.mark.parametrize("partial", (64, 2048))
def test_the_tree_check_runs_a_partial_schema_at_and_past_its_limit(tmp_path, partial):
    """A schema whose PARTIAL reads more than SGLang's 16 bytes (issue 32): the tree check's sources
    hold that many bytes per slot (the differentials run PARTIAL up to each tensor's last byte), and
    check_partial_limit sees a source with fewer refused on both host backends. 2048 is past the
    scenarios' slot cap: their cases then run ALL where they drew PARTIAL."""
    old = "REAL_KV_PARTIAL_READ_BYTES: {type: i32, value: 16,"
    text = DEFAULT_SCHEMA.read_text(encoding="utf-8")
    assert text.count(old) == 1
    text = text.replace(old, f"REAL_KV_PARTIAL_READ_BYTES: {{type: i32, value: {partial},")
    files = render_all(load_schema_text(text, "kernels.yaml"), text, make_environment())
    build_and_run(tmp_path / "tree", files, seeds=1, nvrtc_compile=False)
