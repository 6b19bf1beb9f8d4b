"""Small valid keyword sets of the default tree's launches on the CPU, for tests that change one
argument and expect that argument's error (tests/launch/test_validators.py, tests/launch/test_runtime_hardening.py)."""
from __future__ import annotations

import torch

import kv_canary


def write_kwargs(ctx=None, **over):
    ctx = ctx or kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    plan = kv_canary.WritePlan.allocate(write_req_capacity=2, device="cpu")
    t = torch.zeros(3, dtype=torch.int64)
    kw = dict(context=ctx, plan=plan, input_ids=t, positions=t.clone(), out_cache_loc=t.clone(),
              enable_write_input_assert=False, expected_input_tokens=None, expected_input_positions=None)
    kw.update(over)
    return kw


def verify_kwargs(ctx=None, **over):
    ctx = ctx or kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    kw = dict(context=ctx, plan=kv_canary.VerifyPlan.allocate(verify_capacity=4, device="cpu"),
              check_verify_expected_token=False)
    kw.update(over)
    return kw


def plan_kwargs(**over):
    kw = dict(verify_plan_out=kv_canary.VerifyPlan.allocate(verify_capacity=16, device="cpu"),
              write_plan_out=kv_canary.WritePlan.allocate(write_req_capacity=2, device="cpu"),
              req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([3, 2]), extend_seq_lens=torch.tensor([1, 1]),
              req_to_token=torch.arange(1, 13, dtype=torch.int32).view(3, 4), swa_window_size=2,
              full_to_swa_index_mapping=torch.arange(20), verify_capacity=16, req_to_verify_expected_tokens=None,
              req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0)
    kw.update(over)
    return kw
