"""Where a generated layer's CUDA sources live, and its kernel ABI table.

A generated layer (kv_canary.generated or a tree generated from another schema) is a package
directory; its cuda/*.cu, cuda/kv_canary_layout.cuh and emulation/*.cpp sit beside kernel_abi.py.
The layer's package lists the sha256 of every file of its tree (FILE_SHA256 in its __init__.py, the
tree's one identity file); a source that is not the one listed (a tree that an interrupted `make
generate` left part old, part new, or a hand edit) is refused here, before the CUDA and the emulated
backends compile it.
"""
from __future__ import annotations

import hashlib
import importlib
from pathlib import Path

from .loader import regenerate_command


class MixedTreeError(RuntimeError):
    """A generated source is not the file its layer was generated with."""


def kernel_abi(layer):
    """The layer's generated kernel_abi module (raises a clear error for a tree without one)."""
    try:
        return importlib.import_module(layer.__name__ + ".kernel_abi")
    except ModuleNotFoundError as exc:
        raise ValueError(f"kv-canary: generated layer {layer.__name__} has no kernel_abi.py "
                         f"(generated before the CUDA kernels existed?); run `{regenerate_command(layer)}`") from exc


def tree_dir(layer) -> Path:
    return Path(next(iter(layer.__path__))).resolve()


def read_source(layer, relative: str) -> str:
    """The text of a generated source of `layer`, refused unless it is the file the layer lists."""
    path = tree_dir(layer) / relative
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"kv-canary: generated source {path} is missing ({exc.strerror}); "
                         f"run `{regenerate_command(layer)}`") from None
    listed = getattr(layer, "FILE_SHA256", {}).get(relative)
    if listed is None or hashlib.sha256(text.encode("utf-8")).hexdigest() != listed:
        raise MixedTreeError(f"kv-canary: generated source {path} is not the one its Python layer {layer.__name__} "
                             f"lists (FILE_SHA256 in {tree_dir(layer) / '__init__.py'}): it was edited by hand, or "
                             f"the tree mixes files of two generator runs (an interrupted generator run?); "
                             f"run `{regenerate_command(layer)}`")
    return text
