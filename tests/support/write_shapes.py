"""kernels.yaml with the write kernel's launch shape replaced, generated once per process into a
temporary tree (shared by the emulation and NVRTC tests of the write launch shapes)."""
from __future__ import annotations

import functools
import re

from support.trees import default_schema_text, generate_tree, scratch_dir


@functools.cache
def write_shape_tree(shape: str, threads: int):
    text, n = re.subn(r"(operation: write\n\s*launch: )\{[^}]*\}", rf"\g<1>{{shape: {shape}, threads: {threads}}}",
                      default_schema_text())
    assert n == 1, "kernels.yaml must declare exactly one write kernel"
    path = scratch_dir("kv_canary_write_shape_") / f"write_{shape}_{threads}.yaml"
    path.write_text(text, encoding="utf-8")
    return generate_tree(path)
