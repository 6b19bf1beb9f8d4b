"""Validators: every docs/semantics.md §7 text exactly, and clear errors for wrong dtype/rank/device/length."""
from __future__ import annotations

import dataclasses
import re
from types import SimpleNamespace

import pytest
import torch
from support import scenarios
from support.launch_kwargs import plan_kwargs, verify_kwargs, write_kwargs
from support.trees import default_schema_text, generate_tree

import kv_canary

P = "kv-canary: "


def raises(exc, text):
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


def src(tensor=None, page_size=1, num_bytes_per_token=32, read_bytes=16, alloc=None):
    alloc = alloc or kv_canary.allocators
    tensor = torch.zeros((4, 64), dtype=torch.uint8) if tensor is None else tensor
    return alloc.RealKvSource(tensor=tensor, page_size=page_size, num_bytes_per_token=num_bytes_per_token,
                              read_bytes=read_bytes)


# -- §7 texts -------------------------------------------------------------------------------------------
def test_real_kv_source_texts():
    with raises(ValueError, P + "RealKvSource.page_size must be >= 1, got 0"):
        src(page_size=0)
    with raises(ValueError, P + "RealKvSource.num_bytes_per_token must be a positive multiple of 16, got 24"):
        src(num_bytes_per_token=24)
    with raises(ValueError, P + "RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 48"):
        src(read_bytes=48)
    with raises(ValueError, P + "RealKvSource.read_bytes must be a positive multiple of 16 in (0, num_bytes_per_token=32], got 0"):
        src(read_bytes=0)
    with raises(ValueError, P + "RealKvSource.tensor must be at least 2-D, got shape (64,)"):
        src(tensor=torch.zeros(64, dtype=torch.uint8))
    odd = torch.zeros((4, 40), dtype=torch.uint8)
    with raises(ValueError, P + "RealKvSource.tensor row stride must be a multiple of 16 bytes, got 40 bytes "
                "(shape=(4, 40), strides=(40, 1), dtype=torch.uint8)"):
        src(tensor=odd)
    with raises(ValueError, P + "RealKvSource row is too narrow for its slot layout: dim-1 is 64 bytes but "
                "page_size=4 x num_bytes_per_token=32 needs 128"):
        src(page_size=4)
    # Row width counts every dim after the first, in bytes.
    assert src(tensor=torch.zeros((4, 2, 16), dtype=torch.float16), page_size=2, num_bytes_per_token=32).page_size == 2


def test_source_count_text():
    sources = tuple(src() for _ in range(kv_canary.MAX_REAL_KV_SOURCES + 1))
    # allocate_context checks its sources before allocating; a context assembled by hand when it is
    # built (a frozen VerifyOrWriteContext), another context class at launch.
    with raises(ValueError, P + "at most 4 RealKvSource entries supported by the CUDA ABI, got 5"):
        kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu", real_kv_sources=sources)
    ctx = kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu")
    with raises(ValueError, P + "at most 4 RealKvSource entries supported by the CUDA ABI, got 5"):
        dataclasses.replace(ctx, real_kv_sources=sources)
    foreign = SimpleNamespace(**{f.name: getattr(ctx, f.name) for f in dataclasses.fields(ctx)})
    foreign.real_kv_sources = sources
    with raises(ValueError, P + "at most 4 RealKvSource entries supported by the CUDA ABI, got 5"):
        kv_canary.launch_canary_verify_kernel(**verify_kwargs(foreign))


def test_canary_stride_text():
    ctx = kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu")
    narrow = torch.zeros((4, 24), dtype=torch.uint8)
    with raises(ValueError, P + "canary_buf slot stride must hold at least 4 int64 fields, got 3"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(dataclasses.replace(ctx, canary_buf=narrow)))
    with raises(ValueError, P + "canary_buf slot stride must hold at least 4 int64 fields, got 2"):
        kv_canary.allocators.allocate_canary_buf(4, device="cpu", slot_stride_bytes=16)


def test_contiguous_text():
    ctx = kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu")
    plan = kv_canary.VerifyPlan.allocate(verify_capacity=4, device="cpu")
    strided = torch.zeros(8, dtype=torch.int64)[::2]
    with raises(ValueError, P + "plan.verify_expected_tokens must be contiguous"):
        kv_canary.launch_canary_verify_kernel(**verify_kwargs(ctx, plan=dataclasses.replace(plan, verify_expected_tokens=strided)))
    buf = torch.zeros((32, 4), dtype=torch.uint8).t()
    with raises(ValueError, P + "canary_buf must be contiguous"):
        kv_canary.launch_canary_verify_kernel(**verify_kwargs(dataclasses.replace(ctx, canary_buf=buf)))


def test_expected_input_texts():
    t = torch.zeros(3, dtype=torch.int64)
    with raises(ValueError, P + "expected input tensors are required when enable_write_input_assert=True"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(enable_write_input_assert=True, expected_input_tokens=t))
    with raises(ValueError, P + "expected input tensors must be None when enable_write_input_assert=False"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(expected_input_positions=t))


def test_capacity_texts():
    with raises(ValueError, P + "VerifyPlan verify_capacity must be positive, got 0"):
        kv_canary.VerifyPlan.allocate(verify_capacity=0, device="cpu")
    with raises(ValueError, P + "WritePlan write_req_capacity must be positive, got -2"):
        kv_canary.WritePlan.allocate(write_req_capacity=-2, device="cpu")


def test_swa_index_text_and_nothing_written():
    kw = plan_kwargs(full_to_swa_index_mapping=torch.arange(10))
    before = kw["verify_plan_out"].verify_slot_indices.clone()
    # Request 2 (row 2, prefix 2) reads slots 9 and 10; 10 is outside a 10-entry LUT.
    with raises(ValueError, P + "SWA slot 10 is outside full_to_swa_index_mapping length 10"):
        kv_canary.launch_canary_plan_kernels(**kw)
    assert torch.equal(kw["verify_plan_out"].verify_slot_indices, before)
    assert kw["write_plan_out"].write_num_valid_reqs.item() == 0


# -- other bad inputs ------------------------------------------------------------------------------------
def test_wrong_dtype_rank_length_and_type():
    with raises(TypeError, P + "input_ids must have dtype torch.int64, got torch.int32"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(input_ids=torch.zeros(3, dtype=torch.int32)))
    # A length mismatch between two arguments names both (the second is not the only one that may be wrong).
    with raises(ValueError, P + "positions must have shape (3,), got (4,): its length must equal the length of "
                                "input_ids (3)"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(positions=torch.zeros(4, dtype=torch.int64)))
    with raises(ValueError, P + "input_ids must be 1-D, got shape (3, 1)"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(input_ids=torch.zeros((3, 1), dtype=torch.int64)))
    with raises(TypeError, P + "out_cache_loc must be a torch.Tensor, got list"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(out_cache_loc=[1, 2, 3]))
    with raises(TypeError, P + "enable_write_input_assert must be a bool, got int"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(enable_write_input_assert=1))
    with raises(TypeError, P + "req_to_token must have dtype torch.int32, got torch.int64"):
        kv_canary.launch_canary_plan_kernels(**plan_kwargs(req_to_token=torch.zeros((3, 4), dtype=torch.int64)))
    with raises(ValueError, P + "verify_capacity must equal verify_plan_out capacity 16, got 8"):
        kv_canary.launch_canary_plan_kernels(**plan_kwargs(verify_capacity=8))
    with raises(ValueError, P + "full_to_swa_index_mapping is required when swa_window_size > 0, got None"):
        kv_canary.launch_canary_plan_kernels(**plan_kwargs(full_to_swa_index_mapping=None))
    with raises(ValueError, P + "req_pool_indices holds 3 requests but write_plan_out.write_req_capacity is 2"):
        kv_canary.launch_canary_plan_kernels(**plan_kwargs(req_pool_indices=torch.tensor([1, 2, 0]),
                                                           prefix_lens=torch.tensor([1, 1, 1])))
    with raises(ValueError, P + "offsets must have shape (3,), got (2,): its length must equal the length of "
                                "req_pool_indices (2) + 1"):
        kv_canary.scatter_req_token_ids(flat_in=torch.zeros(4, dtype=torch.int64), offsets=torch.zeros(2, dtype=torch.int64),
                                        req_pool_indices=torch.tensor([1, 2]), pool_out=torch.zeros((3, 4), dtype=torch.int32))
    tags = ", ".join(f"{t.name}={int(t)}" for t in kv_canary.CanaryLaunchTag)
    with raises(ValueError, P + f"kernel_kind must be a CanaryLaunchTag ({tags}), got 99"):
        ctx = kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu")
        kv_canary.launch_canary_verify_kernel(**verify_kwargs(dataclasses.replace(ctx, kernel_kind=99)))
    ring_ctx = kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu")
    with raises(ValueError, P + f"violation_ring must have shape (*, {kv_canary.VIOLATION_FIELDS}), got (4, 3)"):
        kv_canary.launch_canary_verify_kernel(**verify_kwargs(dataclasses.replace(
            ring_ctx, violation_ring=torch.zeros((4, 3), dtype=torch.int64))))


def test_wrong_device_is_named():
    meta = torch.zeros(3, dtype=torch.int64, device="meta")
    with raises(ValueError, P + "input_ids must be on cpu (the device of canary_buf), got meta"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(input_ids=meta))


def test_extra_keywords_rejected_for_default_schema():
    # The public functions of the default schema have no such keyword (docs/semantics.md §8); the Runtime
    # behind them (what the manager calls) accepts the mappings and validates them.
    with pytest.raises(TypeError, match="unexpected keyword argument 'extra_inputs'"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(extra_inputs={}))
    rt = scenarios.runtime_for(kv_canary.generated)
    with raises(ValueError, P + "extra_inputs must have exactly the keys [no fields (this schema declares none)], got [epoch]"):
        rt.launch_canary_write_kernel(**write_kwargs(extra_inputs={"epoch": torch.zeros(3, dtype=torch.int64)}))
    rt.launch_canary_write_kernel(**write_kwargs(extra_inputs={}))
    rt.launch_canary_verify_kernel(**verify_kwargs(extra_slot_tables=None))


# -- a mutated schema: stride 64 plus an input field ----------------------------------------------------------
@pytest.fixture(scope="module")
def epoch_tree(tmp_path_factory):
    text = default_schema_text(stride=64)
    text = text.replace("      - {name: real_kv_hash, role: kv_fingerprint}\n",
                        "      - {name: real_kv_hash, role: kv_fingerprint}\n"
                        "      - {name: epoch, role: input, source: allocation_epoch, verify: {expected: per_slot, fail_reason: VERIFY_EPOCH_MISMATCH}}\n")
    text = text.replace("    SLOT_OUT_OF_RANGE: 64\n", "    SLOT_OUT_OF_RANGE: 64\n    VERIFY_EPOCH_MISMATCH: {value: 128, kind: verify}\n")
    path = tmp_path_factory.mktemp("schema") / "epoch64.yaml"
    path.write_text(text)
    return generate_tree(path)


def test_mutated_schema_messages_and_extra_keywords(epoch_tree):
    val = epoch_tree.validators
    alloc = epoch_tree.allocators
    assert val.message("canary_stride", n=4) == P + "canary_buf slot stride must hold at least 5 int64 fields, got 4"
    with raises(ValueError, P + "canary_buf slot stride must hold at least 5 int64 fields, got 4"):
        alloc.allocate_canary_buf(4, device="cpu", slot_stride_bytes=32)
    assert alloc.allocate_canary_buf(4, device="cpu").shape == (4, 64)
    rt = scenarios.runtime_for(epoch_tree)
    ctx = alloc.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    wplan = alloc.WritePlan.allocate(write_req_capacity=1, device="cpu")
    t = torch.zeros(2, dtype=torch.int64)
    kw = dict(context=ctx, plan=wplan, input_ids=t, positions=t, out_cache_loc=t, enable_write_input_assert=False)
    with raises(ValueError, P + "extra_inputs must have exactly the keys [epoch], got []"):
        rt.launch_canary_write_kernel(**kw)
    with raises(TypeError, P + "extra_inputs['epoch'] must have dtype torch.int64, got torch.int32"):
        rt.launch_canary_write_kernel(**kw, extra_inputs={"epoch": t.to(torch.int32)})
    vplan = alloc.VerifyPlan.allocate(verify_capacity=2, device="cpu")
    with raises(ValueError, P + "extra_slot_tables['epoch'] must have shape (8,), got (2,): its length must equal "
                                "dimension 0 of canary_buf (8)"):
        rt.launch_canary_verify_kernel(context=ctx, plan=vplan, check_verify_expected_token=False,
                                       extra_slot_tables={"epoch": t})
