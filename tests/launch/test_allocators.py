"""Allocators give the sizes, dtypes and initial values the schema implies (any schema)."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import kv_canary


def alloc_of(tree):
    return tree.allocators


def nbytes(obj) -> int:
    return sum(getattr(obj, f.name).nbytes for f in dataclasses.fields(obj))


def test_canary_buffer_and_ring(any_tree):
    lay, alloc = any_tree.layout, alloc_of(any_tree)
    buf = alloc.allocate_canary_buf(10, device="cpu")
    assert buf.shape == (10, lay.CANARY_SLOT_STRIDE_BYTES) and buf.dtype == torch.uint8 and not buf.any()
    assert lay.CANARY_SLOT_STRIDE_BYTES >= lay.CANARY_FIELDS_PER_SLOT * 8
    assert alloc.canary_buf_bytes(10) == buf.nbytes
    ring, index = alloc.allocate_violation_ring(7, device="cpu")
    assert ring.shape == (7, lay.VIOLATION_FIELDS) and ring.dtype == torch.int64 and not ring.any()
    assert index.shape == (1,) and index.dtype == torch.int32 and index.item() == 0
    assert alloc.violation_ring_bytes(7) == ring.nbytes + index.nbytes
    counter = alloc.allocate_counter(device="cpu")
    assert counter.dtype == torch.int64 and counter.shape == (1,) and counter.item() == 0
    flag = alloc.allocate_chain_position_flag(device="cpu", enabled=True)
    assert flag.dtype == torch.int32 and flag.item() == 1


def test_verify_plan(any_tree):
    lay, alloc = any_tree.layout, alloc_of(any_tree)
    plan = alloc.VerifyPlan.allocate(verify_capacity=5, device="cpu")
    per_request = [f.name for f in lay.INPUT_FIELDS if f.verify_expected == "per_request"]
    arrays = ["verify_slot_indices", "verify_expected_tokens", "verify_expected_positions", "verify_prev_slot_indices",
              *("verify_expected_" + n for n in per_request)]
    for name in arrays:
        t = getattr(plan, name)
        assert t.shape == (5,) and t.dtype == torch.int64
    assert plan.verify_expected_tokens.tolist() == [-1] * 5            # unknown until a plan fills them
    for name in ("verify_slot_indices", "verify_expected_positions", "verify_prev_slot_indices"):
        assert getattr(plan, name).tolist() == [0] * 5, name             # SGLang: torch.empty (any bytes)
    assert plan.verify_num_valid.dtype == torch.int32 and plan.verify_num_valid.item() == 0
    assert plan.enable.dtype == torch.int32 and plan.enable.item() == 1
    assert alloc.VerifyPlan.allocation_bytes(5) == nbytes(plan) == 5 * 8 * len(arrays) + 8


def test_write_plan(any_tree):
    alloc = alloc_of(any_tree)
    plan = alloc.WritePlan.allocate(write_req_capacity=3, device="cpu")
    assert plan.write_offsets.shape == (4,) and plan.write_offsets.dtype == torch.int64
    assert plan.write_seed_slot_indices.shape == (3,) and plan.write_seed_slot_indices.dtype == torch.int64
    assert plan.write_num_valid_reqs.dtype == torch.int32 and plan.write_num_valid_reqs.item() == 0
    assert plan.write_offsets.tolist() == [0] * 4 and plan.write_seed_slot_indices.tolist() == [-1] * 3
    assert alloc.WritePlan.allocation_bytes(3) == nbytes(plan) == 4 * 8 + 3 * 8 + 4


def test_context_uses_keywords_and_shares_nothing(any_tree):
    lay, alloc = any_tree.layout, alloc_of(any_tree)
    a = alloc.allocate_context(num_slots=4, ring_capacity=2, device="cpu", slot_stride_bytes=lay.CANARY_SLOT_STRIDE_BYTES + 8)
    b = alloc.allocate_context(num_slots=4, ring_capacity=2, device="cpu")
    assert a.canary_buf.shape[1] == lay.CANARY_SLOT_STRIDE_BYTES + 8
    assert a.violation_ring.data_ptr() != b.violation_ring.data_ptr()
    assert a.kernel_kind == next(iter(lay.CanaryLaunchTag)) and a.real_kv_hash_mode == lay.RealKvHashMode.NONE
    shared = dataclasses.replace(b, kernel_kind=lay.CanaryLaunchTag(1))
    assert shared.violation_ring is b.violation_ring


# -- bad allocator arguments get a clear ValueError/TypeError naming the argument ------------------
def test_bad_allocator_arguments_are_named():
    lay = kv_canary.generated.layout
    with pytest.raises(ValueError, match=r"^kv-canary: kernel_kind must be a CanaryLaunchTag \(HEAD_K_FULL=0, .*\), got 99$"):
        kv_canary.allocate_context(num_slots=4, ring_capacity=2, device="cpu", kernel_kind=99)
    with pytest.raises(ValueError, match=r"^kv-canary: real_kv_hash_mode must be a RealKvHashMode \(NONE=0, PARTIAL=1, ALL=2\), got 7$"):
        kv_canary.allocate_context(num_slots=4, ring_capacity=2, device="cpu", real_kv_hash_mode=7)
    with pytest.raises(ValueError, match=r"^kv-canary: device must be a torch.device or a device string .*, got 'nope'$"):
        kv_canary.VerifyPlan.allocate(verify_capacity=4, device="nope")
    with pytest.raises(ValueError, match=r"^kv-canary: device must be .*, got 'nope'$"):
        kv_canary.WritePlan.allocate(write_req_capacity=4, device="nope")
    with pytest.raises(TypeError, match=r"^kv-canary: enabled must be a bool, got int$"):
        kv_canary.allocate_chain_position_flag(device="cpu", enabled=1)
    # numpy integer scalars are integers; bools are not.
    ctx = kv_canary.allocate_context(num_slots=np.int64(4), ring_capacity=np.int32(2), device="cpu",
                                     kernel_kind=np.int64(int(lay.CanaryLaunchTag.TAIL_V_SWA)))
    assert ctx.kernel_kind is lay.CanaryLaunchTag.TAIL_V_SWA and ctx.canary_buf.shape[0] == 4
    src = kv_canary.RealKvSource(tensor=torch.zeros((2, 64), dtype=torch.uint8), page_size=np.int64(1),
                                 num_bytes_per_token=np.int32(32), read_bytes=np.int16(16))
    assert src.page_size == 1
    with pytest.raises(TypeError, match=r"^kv-canary: RealKvSource.page_size must be an int, got bool$"):
        kv_canary.RealKvSource(tensor=torch.zeros((2, 64), dtype=torch.uint8), page_size=True,
                               num_bytes_per_token=32, read_bytes=16)


def test_allocators_is_a_module_of_the_tree(any_tree):
    """`from <tree>.allocators import allocate_context` (docs/schema-change.md §7): a module whose
    names are the runtime's allocators for that tree, the same whichever way they are reached."""
    import importlib
    import types

    module = importlib.import_module(f"{any_tree.__name__}.allocators")
    assert isinstance(module, types.ModuleType) and any_tree.allocators is module
    runtime = kv_canary.runtime_for(any_tree).allocators
    assert sorted(module.__all__) == sorted(runtime.__all__)
    scope: dict = {}
    exec(f"from {any_tree.__name__}.allocators import *", scope)
    for name in runtime.__all__:
        assert scope[name] is getattr(runtime, name) is getattr(module, name)
    ctx = module.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    assert ctx.canary_buf.shape[0] == 8
    with pytest.raises(AttributeError, match="has no attribute 'allocate_nothing'"):
        module.allocate_nothing
