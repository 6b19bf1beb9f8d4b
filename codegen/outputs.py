"""The table of generated files: which template renders which file of generated/.

Adding a generated file = adding a template under templates/ and a row here.
"""
from __future__ import annotations

# (template, output path relative to generated/), rendered once each, in this order.
STATIC_OUTPUTS = (
    ("python/__init__.py.j2", "__init__.py"),
    ("python/layout.py.j2", "layout.py"),
    ("python/reference.py.j2", "reference.py"),
    ("python/api.py.j2", "api.py"),
    ("docs/LAYOUT.md.j2", "LAYOUT.md"),
    ("cuda/kv_canary_layout.cuh.j2", "cuda/kv_canary_layout.cuh"),
    ("python/kernel_abi.py.j2", "kernel_abi.py"),
    ("emulation/launchers.cpp.j2", "emulation/kv_canary_launchers.cpp"),
)

# kernels.yaml `template:` name -> the Jinja template of that kernel's CUDA source, rendered once
# per kernel into cuda/<kernel name>.cu with `kernel` in its context.
KERNEL_SOURCE_TEMPLATES: dict[str, str] = {
    "write": "cuda/write.cu.j2",
    "verify": "cuda/verify.cu.j2",
    "plan_offsets": "cuda/plan_offsets.cu.j2",
    "plan_entries": "cuda/plan_entries.cu.j2",
    "scatter": "cuda/scatter.cu.j2",
}
