"""Where a generated layer's CUDA sources live, and its kernel ABI table.

A generated layer (kv_canary.generated or a tree generated from another schema) is a package
directory; its cuda/*.cu, cuda/kv_canary_layout.cuh and emulation/*.cpp sit beside kernel_abi.py.
Every generated file names its generator run in its header (`generation-id:`); a source from
another run than the layer's Python package (a tree that an interrupted `make generate` left part
old, part new) is refused here, before the CUDA and the emulated backends compile it.
"""
from __future__ import annotations

import importlib
import re
from pathlib import Path

from .loader import regenerate_command

_GENERATION_LINE = re.compile(r"generation-id: ([0-9a-f]{16})")
HEADER_LINES = 5  # the generator's header (codegen/render.py make_header)


class MixedTreeError(RuntimeError):
    """A generated source does not come from the same generator run as its layer."""


def kernel_abi(layer):
    """The layer's generated kernel_abi module (raises a clear error for a tree without one)."""
    try:
        return importlib.import_module(layer.__name__ + ".kernel_abi")
    except ModuleNotFoundError as exc:
        raise ValueError(f"kv-canary: generated layer {layer.__name__} has no kernel_abi.py "
                         f"(generated before the CUDA kernels existed?); run `{regenerate_command(layer)}`") from exc


def tree_dir(layer) -> Path:
    return Path(next(iter(layer.__path__))).resolve()


def source_generation(text: str) -> str | None:
    """The generation id in a generated file's header (None when it has none)."""
    for line in text.split("\n", HEADER_LINES)[:HEADER_LINES]:
        match = _GENERATION_LINE.search(line)
        if match:
            return match.group(1)
    return None


def read_source(layer, relative: str) -> str:
    """The text of a generated source of `layer`, refused unless it is from the layer's generation."""
    path = tree_dir(layer) / relative
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ValueError(f"kv-canary: generated source {path} is missing ({exc.strerror}); "
                         f"run `{regenerate_command(layer)}`") from None
    want, got = getattr(layer, "GENERATION_ID", None), source_generation(text)
    if want is None or got != want:
        raise MixedTreeError(f"kv-canary: generated source {path} is from generation {got or '(none)'} but its "
                             f"Python layer {layer.__name__} is from generation {want or '(none)'}: the tree "
                             f"{tree_dir(layer)} mixes files of two generator runs (an interrupted "
                             f"generator run?); run `{regenerate_command(layer)}`")
    return text
