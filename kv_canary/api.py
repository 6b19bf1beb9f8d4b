"""The SGLang-compatible launch API on the default generated layer (kv_canary.generated).

Each function takes SGLang's keywords plus an optional `backend=` ('torch', 'cuda', 'emulated');
see kv_canary.runtime for how the backend is chosen otherwise. For another schema's layer use
`kv_canary.runtime_for(layer)`, which has the same methods.
"""
from __future__ import annotations

import sys

from .runtime import runtime_for

_rt = runtime_for(sys.modules["kv_canary.generated"])

launch_canary_write_kernel = _rt.launch_canary_write_kernel
launch_canary_verify_kernel = _rt.launch_canary_verify_kernel
launch_canary_plan_kernels = _rt.launch_canary_plan_kernels
scatter_req_token_ids = _rt.scatter_req_token_ids
launch_canary_write_kernel_torch_reference = _rt.launch_canary_write_kernel_torch_reference
launch_canary_verify_kernel_torch_reference = _rt.launch_canary_verify_kernel_torch_reference
launch_canary_plan_kernels_torch_reference = _rt.launch_canary_plan_kernels_torch_reference
scatter_req_token_ids_torch_reference = _rt.scatter_req_token_ids_torch_reference

__all__ = [
    "launch_canary_write_kernel", "launch_canary_verify_kernel", "launch_canary_plan_kernels", "scatter_req_token_ids",
    "launch_canary_write_kernel_torch_reference", "launch_canary_verify_kernel_torch_reference",
    "launch_canary_plan_kernels_torch_reference", "scatter_req_token_ids_torch_reference",
]
