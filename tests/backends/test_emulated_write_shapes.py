"""The write kernel's two launch shapes against the torch reference, in emulation.

`block_per_request` (kernels.yaml's default) takes a request's entries in double-buffered chunks:
thread 0 walks chunk k's chain while the other warps check and store chunk k-1 and stage chunk k+1;
`per_request` (SGLang's) walks a request in one thread. Requests here are long enough to span
several chunks (the emulated block has 64 threads by default: chunks of one stager warp; the
32-thread variant has one warp that walks and stages in turn; the full-block test runs kernels.yaml's
256 threads: chunks of 224 across seven stager warps), and half of the cases overlap requests
(duplicate slots, seeds written earlier in the batch). Emulated blocks run in order and each stager
appends its rows before its warp's first collective, in thread order, so every row must land exactly
where the reference puts it. Cases per shape: 24 x KV_CANARY_CASES (full block: 4 x; tests/support/budget.py).
"""
from __future__ import annotations

import random
import shutil

import pytest
from support import budget, scenarios
from support.kernel_diff import compare
from support.write_shapes import write_shape_tree

import kv_canary
from kv_canary.trees.sources import kernel_abi, read_source

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

CASES = budget.cases(24)


@pytest.fixture(scope="module", params=[("default", 0), ("block_per_request", 32), ("per_request", 128)],
                ids=lambda p: f"{p[0]}_{p[1]}" if p[1] else p[0])
def shaped_tree(request):
    shape, threads = request.param
    if shape == "default":
        return kv_canary.generated
    tree = write_shape_tree(shape, threads)
    write = kernel_abi(tree).kernel_for_operation("write")
    assert (write.shape, write.threads) == (shape, threads)
    return tree


def test_default_write_is_block_per_request(default_tree):
    write = kernel_abi(default_tree).kernel_for_operation("write")
    assert write.shape == "block_per_request" and write.threads % 32 == 0
    assert f"kvc_write::block_per_request<{write.threads}, " in read_source(default_tree, write.source)


def test_long_requests_match_reference_in_both_shapes(shaped_tree):
    kv_canary.runtime_for(shaped_tree).backend("emulated")   # build once, outside the per-case loop
    for seed in range(CASES):
        rng = random.Random(seed)
        case = scenarios.make_write_case(rng, shaped_tree, n_reqs=rng.randint(1, 6), max_extend=160,
                                         overlap=rng.random() < 0.5)
        try:
            compare(shaped_tree, "write", case, "emulated", ordered=True)
        except AssertionError as exc:
            raise AssertionError(f"write case seed={seed} ({shaped_tree.__name__}): {exc}") from None



def test_full_block_with_repeated_slots_matches_reference(default_tree, monkeypatch):
    """kernels.yaml's whole block (warp 0 walks, the other warps stage chunks of threads - 32) over
    requests of several chunks, half of them with slots repeated many times inside one request: in
    one chunk across lanes and warps, and across chunks (scenarios.crowd_slots)."""
    backend = kv_canary.runtime_for(default_tree).backend("emulated")
    write = kernel_abi(default_tree).kernel_for_operation("write")
    assert write.threads > 64, "kernels.yaml's write block is no wider than the emulation's default"
    monkeypatch.setattr(backend, "threads", write.threads)
    for seed in range(max(1, int(4 * budget.MULTIPLIER))):
        rng = random.Random(seed)
        case = scenarios.make_write_case(rng, default_tree, n_reqs=rng.randint(1, 4), max_extend=3 * write.threads,
                                         overlap=rng.random() < 0.5)
        if seed % 2:
            scenarios.crowd_slots(rng, case)
        try:
            compare(default_tree, "write", case, "emulated", ordered=True)
        except AssertionError as exc:
            raise AssertionError(f"full-block write case seed={seed}: {exc}") from None
