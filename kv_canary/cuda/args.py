"""Kernel arguments by name, in the order of the generated parameter lists (kernel_abi.py).

Values are tensors (passed zero-copy as their data pointer, dtype checked against the C element
type), None (a null pointer) or ints. The result is a list of (kind, int) with kind "ptr", "i64"
or "i32", which the CUDA and emulation launchers turn into their own argument types.
"""
from __future__ import annotations

import torch

# C element type of a pointer parameter -> the torch dtype a tensor passed for it must have.
POINTER_DTYPES = {
    "long long": torch.int64,
    "unsigned long long": torch.int64,
    "int": torch.int32,
    "unsigned char": torch.uint8,
}
SCALAR_KINDS = {"long long": "i64", "int": "i32"}


def _element_type(ctype: str) -> str:
    return ctype.replace("const ", "").rstrip("*").strip()


def pack(kernel, values: dict, *, device: torch.device) -> list[tuple[str, int]]:
    """Order `values` like kernel.params; every parameter must be given exactly once."""
    missing = [name for name, _ in kernel.params if name not in values]
    extra = sorted(set(values) - {name for name, _ in kernel.params})
    if missing or extra:
        raise ValueError(f"kv-canary: arguments of kernel {kernel.name} do not match its generated parameter "
                         f"list: missing {missing}, unexpected {extra} (is generated/ up to date? run `make generate`)")
    packed = []
    for name, ctype in kernel.params:
        value = values[name]
        if ctype.endswith("*"):
            packed.append(("ptr", _pointer(kernel, name, ctype, value, device)))
        else:
            if isinstance(value, torch.Tensor) or not isinstance(value, int):
                raise TypeError(f"kv-canary: kernel {kernel.name} argument {name} must be an int, got {type(value).__name__}")
            packed.append((SCALAR_KINDS[ctype], int(value)))
    return packed


def _pointer(kernel, name: str, ctype: str, value, device: torch.device) -> int:
    if value is None:
        return 0
    if isinstance(value, int):  # an address computed by the caller (real-KV bytes)
        return value
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"kv-canary: kernel {kernel.name} argument {name} must be a tensor, got {type(value).__name__}")
    want = POINTER_DTYPES[_element_type(ctype)]
    if value.dtype != want:
        raise TypeError(f"kv-canary: kernel {kernel.name} argument {name} must have dtype {want}, got {value.dtype}")
    if value.device != device:
        raise ValueError(f"kv-canary: kernel {kernel.name} argument {name} must be on {device}, got {value.device}")
    return value.data_ptr()
