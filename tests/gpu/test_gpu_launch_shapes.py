"""Launch grids of the CUDA backend, checked without a GPU: the rules that turn kernels.yaml's launch
shapes (and, on a GPU, the compiled kernel's occupancy) into grid sizes."""
from __future__ import annotations

import dataclasses

import kv_canary
from kv_canary.backends.cuda import persistent_grid
from kv_canary.backends.kernels import blocks_for
from kv_canary.trees.sources import kernel_abi


def test_launch_grids_follow_the_schema_and_the_occupancy():
    """Grid rules of the CUDA backend (no GPU needed): persistent = SM count x min(blocks_per_sm,
    resident blocks), never more blocks than the capacity fills; fixed_grid pins kernels.yaml's grid."""
    verify = kernel_abi(kv_canary.generated).kernel_for_operation("verify")
    assert verify.shape == "persistent" and verify.blocks_per_sm == 8
    assert persistent_grid(132, verify.blocks_per_sm, 5) == 660        # occupancy below the schema's 8
    assert persistent_grid(132, verify.blocks_per_sm, 16) == 1056      # the schema's value is the bound
    assert persistent_grid(132, verify.blocks_per_sm, 0) == 1056       # occupancy unknown
    assert blocks_for(verify, 1 << 20, threads=256, persistent_blocks=660) == 660
    assert blocks_for(verify, 300, threads=256, persistent_blocks=660) == 2  # a small plan: a small grid
    sglang = dataclasses.replace(verify, shape="fixed_grid", threads=512, blocks=64, blocks_per_sm=0)
    assert blocks_for(sglang, 1 << 20, threads=512, persistent_blocks=0) == 64
    # write: block_per_request covers the plan's capacity with one block per request whatever the
    # block size (the active count is on the device; blocks past it exit); per_request packs
    # `threads` requests into a block.
    write = kernel_abi(kv_canary.generated).kernel_for_operation("write")
    assert write.shape == "block_per_request"
    assert blocks_for(write, 257, threads=write.threads, persistent_blocks=0) == 257
    assert blocks_for(write, 257, threads=32, persistent_blocks=0) == 257
    assert blocks_for(write, 1, threads=write.threads, persistent_blocks=0) == 1
    sglang_write = dataclasses.replace(write, shape="per_request", threads=128)
    assert blocks_for(sglang_write, 257, threads=128, persistent_blocks=0) == 3
