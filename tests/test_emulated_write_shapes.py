"""The write kernel's two launch shapes (issue 4 §1) against the torch reference, in emulation.

`block_per_request` (kernels.yaml's default) stages a request's entries in chunks of blockDim.x and
lets thread 0 walk each chunk; `per_request` (SGLang's) walks a request in one thread. Requests here
are long enough to span several chunks (the emulated block has at most 64 threads; the 32-thread
variant makes every chunk a single warp), and half of the cases overlap requests (duplicate slots,
seeds written earlier in the batch): emulated blocks run in order, so every row must land exactly
where the reference puts it. Cases per shape: 80 x KV_CANARY_CASES.
"""
from __future__ import annotations

import os
import random
import shutil

import pytest
import scenarios
from kernel_diff import compare
from write_shapes import write_shape_layer

import kv_canary
from kv_canary.cuda.sources import kernel_abi, read_source

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")

CASES = max(1, int(80 * float(os.environ.get("KV_CANARY_CASES", "1"))))


@pytest.fixture(scope="module", params=[("default", 0), ("block_per_request", 32), ("per_request", 128)],
                ids=lambda p: f"{p[0]}_{p[1]}" if p[1] else p[0])
def shaped_layer(request):
    shape, threads = request.param
    if shape == "default":
        return kv_canary.generated
    layer = write_shape_layer(shape, threads)
    write = kernel_abi(layer).kernel_for_template("write")
    assert (write.shape, write.threads) == (shape, threads)
    return layer


def test_default_write_is_block_per_request(default_layer):
    write = kernel_abi(default_layer).kernel_for_template("write")
    assert write.shape == "block_per_request" and write.threads % 32 == 0
    assert "__syncthreads()" in read_source(default_layer, write.source)


def test_long_requests_match_reference_in_both_shapes(shaped_layer):
    kv_canary.runtime_for(shaped_layer).backend("emulated")  # build once, outside the per-case loop
    for seed in range(CASES):
        rng = random.Random(seed)
        case = scenarios.make_write_case(rng, shaped_layer, n_reqs=rng.randint(1, 6), max_extend=160,
                                         overlap=rng.random() < 0.5)
        try:
            compare(shaped_layer, "write", case, "emulated", ordered=True)
        except AssertionError as exc:
            raise AssertionError(f"write case seed={seed} ({shaped_layer.__name__}): {exc}") from None

