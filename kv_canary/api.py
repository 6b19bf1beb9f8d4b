"""The SGLang-compatible launch API on the default generated layer (kv_canary.generated).

The functions are generated from kernels.yaml (generated/api.py), so their signatures are exactly
SGLang's plus `backend=` ('torch', 'cuda', 'emulated'; see kv_canary.runtime for the default
choice), with the keywords of schema-declared input fields only when the schema declares them.
Another schema's layer has the same module as `<layer>.api` (or `kv_canary.runtime_for(layer).api`).
"""
from __future__ import annotations

from .generated.api import (
    launch_canary_plan_kernels,
    launch_canary_plan_kernels_torch_reference,
    launch_canary_verify_kernel,
    launch_canary_verify_kernel_torch_reference,
    launch_canary_write_kernel,
    launch_canary_write_kernel_torch_reference,
    launch_scatter_req_token_ids_kernel,
    scatter_req_token_ids,
    scatter_req_token_ids_torch_reference,
)

__all__ = [
    "launch_canary_write_kernel", "launch_canary_verify_kernel", "launch_canary_plan_kernels", "scatter_req_token_ids",
    "launch_canary_write_kernel_torch_reference", "launch_canary_verify_kernel_torch_reference",
    "launch_canary_plan_kernels_torch_reference", "scatter_req_token_ids_torch_reference",
    "launch_scatter_req_token_ids_kernel",
]
