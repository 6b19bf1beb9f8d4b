"""kv-canary's launchers under SGLang's names and signatures, registered with SGLang's hook registry.

SGLang's runtime passes its own data classes (`VerifyOrWriteContext`, `RealKvSource`, `VerifyPlan`,
`WritePlan` from sglang.kernels.ops.kv_canary); each call rewraps them as kv-canary's over the very
same tensors (no copy) and runs kv-canary's launch on the backend kv-canary chooses (`backend=` is
never passed: the tensors' device and KV_CANARY_BACKEND decide, as for any kv-canary launch).
"""
from __future__ import annotations

import dataclasses
import os

import kv_canary as kvc

_OPS = "sglang.kernels.ops.kv_canary"
TARGETS = {
    "verify": f"{_OPS}.verify.launch_canary_verify_kernel",
    "write": f"{_OPS}.write.launch_canary_write_kernel",
    "plan": f"{_OPS}.plan.api.launch_canary_plan_kernels",
    "scatter": f"{_OPS}.scatter_req_token_ids.launch_scatter_req_token_ids_kernel",
    "use_torch_reference": f"{_OPS}._dispatch.use_torch_reference",
}


def _same_fields(cls, value):
    """cls over value's fields; a field of ours with a default that SGLang's class lacks (the
    RealKvSource layout fields) keeps its default."""
    return cls(**{f.name: getattr(value, f.name) for f in dataclasses.fields(cls)
                  if f.default is dataclasses.MISSING or hasattr(value, f.name)})


def as_real_kv_source(source):
    return _same_fields(kvc.RealKvSource, source)


def as_context(context):
    """SGLang's VerifyOrWriteContext as kv-canary's: the same tensors, kv-canary's enums."""
    return kvc.VerifyOrWriteContext(
        canary_buf=context.canary_buf, kernel_kind=kvc.CanaryLaunchTag(int(context.kernel_kind)),
        violation_ring=context.violation_ring, violation_write_index=context.violation_write_index,
        slot_run_counter=context.slot_run_counter, kernel_run_counter=context.kernel_run_counter,
        real_kv_sources=tuple(as_real_kv_source(s) for s in context.real_kv_sources),
        real_kv_hash_mode=kvc.RealKvHashMode(int(context.real_kv_hash_mode)),
        enable_chain_position_assert=context.enable_chain_position_assert)


def as_verify_plan(plan):
    return _same_fields(kvc.VerifyPlan, plan)


def as_write_plan(plan):
    return _same_fields(kvc.WritePlan, plan)


def launch_canary_verify_kernel(*, context, plan, check_verify_expected_token: bool) -> None:
    kvc.launch_canary_verify_kernel(context=as_context(context), plan=as_verify_plan(plan),
                                    check_verify_expected_token=check_verify_expected_token)


def launch_canary_write_kernel(*, context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert: bool,
                               expected_input_tokens, expected_input_positions) -> None:
    kvc.launch_canary_write_kernel(context=as_context(context), plan=as_write_plan(plan), input_ids=input_ids,
                                   positions=positions, out_cache_loc=out_cache_loc,
                                   enable_write_input_assert=enable_write_input_assert,
                                   expected_input_tokens=expected_input_tokens,
                                   expected_input_positions=expected_input_positions)


def launch_canary_plan_kernels(*, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens, extend_seq_lens,
                               req_to_token, swa_window_size: int, full_to_swa_index_mapping, verify_capacity: int,
                               req_to_verify_expected_tokens, req_to_verify_expected_tokens_valid_lens,
                               kv_token_id_vs_position_offset: int) -> None:
    kvc.launch_canary_plan_kernels(
        verify_plan_out=as_verify_plan(verify_plan_out), write_plan_out=as_write_plan(write_plan_out),
        req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
        req_to_token=req_to_token, swa_window_size=swa_window_size,
        full_to_swa_index_mapping=full_to_swa_index_mapping, verify_capacity=verify_capacity,
        req_to_verify_expected_tokens=req_to_verify_expected_tokens,
        req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
        kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)


def launch_scatter_req_token_ids_kernel(*, flat_in, offsets, req_pool_indices, pool_out) -> None:
    kvc.launch_scatter_req_token_ids_kernel(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                                            pool_out=pool_out)


def use_torch_reference(device) -> bool:
    """SGLang's predicate answered by kv-canary's launches (its CUDA-graph guard asks it)."""
    return kvc.use_torch_reference(device)


REPLACEMENTS = {
    "verify": launch_canary_verify_kernel,
    "write": launch_canary_write_kernel,
    "plan": launch_canary_plan_kernels,
    "scatter": launch_scatter_req_token_ids_kernel,
    "use_torch_reference": use_torch_reference,
}


def default_backend() -> str:
    """The backend kv-canary's launches pick for this process's default device."""
    import torch

    chosen = os.environ.get("KV_CANARY_BACKEND") or None
    if chosen:
        return chosen
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return "torch" if kvc.use_torch_reference(device) else "cuda"


def register() -> str:
    """REPLACE hooks for every target (SGLang applies them after all plugins ran); returns the backend."""
    from sglang.srt.plugins.hook_registry import HookRegistry, HookType

    backend = default_backend()
    for name, target in TARGETS.items():
        HookRegistry.register(target, REPLACEMENTS[name], HookType.REPLACE)
    return backend
