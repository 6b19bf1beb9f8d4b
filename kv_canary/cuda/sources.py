"""Where a generated layer's CUDA sources live, and its kernel ABI table.

A generated layer (kv_canary.generated or a tree generated from another schema) is a package
directory; its cuda/*.cu, cuda/kv_canary_layout.cuh and emulation/*.cpp sit beside kernel_abi.py.
"""
from __future__ import annotations

import importlib
from pathlib import Path


def kernel_abi(layer):
    """The layer's generated kernel_abi module (raises a clear error for a tree without one)."""
    try:
        return importlib.import_module(layer.__name__ + ".kernel_abi")
    except ModuleNotFoundError as exc:
        raise ValueError(f"kv-canary: generated layer {layer.__name__} has no kernel_abi.py "
                         f"(generated before the CUDA kernels existed?); run `make generate`") from exc


def tree_dir(layer) -> Path:
    return Path(next(iter(layer.__path__))).resolve()


def read_source(layer, relative: str) -> str:
    path = tree_dir(layer) / relative
    try:
        return path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"kv-canary: generated source {path} is missing ({exc.strerror}); "
                         f"run `make generate`") from None
