"""The table of generated files: which template renders which file of generated/.

Adding a generated file = adding a template under templates/ and a row here (a kernel's CUDA source
follows from its operation's entry in codegen/operations.py).
"""
from __future__ import annotations

from .operations import OPERATIONS

# (template, output path relative to generated/), rendered once each, in this order.
STATIC_OUTPUTS = (
    ("python/__init__.py.j2", "__init__.py"),
    ("python/layout.py.j2", "layout.py"),
    ("python/reference.py.j2", "reference.py"),
    ("python/api.py.j2", "api.py"),
    ("python/allocators.py.j2", "allocators.py"),
    ("docs/LAYOUT.md.j2", "LAYOUT.md"),
    ("cuda/kv_canary_layout.cuh.j2", "cuda/kv_canary_layout.cuh"),
    ("python/kernel_abi.py.j2", "kernel_abi.py"),
    ("emulation/launchers.cpp.j2", "emulation/kv_canary_launchers.cpp"),
    ("cpu/kernels.cpp.j2", "cpu/kv_canary_cpu.cpp"),
)

# kernels.yaml `operation:` -> the Jinja template of that kernel's CUDA source (its operation's
# KernelTemplateSpec.source_template), rendered once per kernel into cuda/<kernel name>.cu with the
# kernel's typed context (codegen/cuda_context.py); a kernel whose launch shapes differ in device code
# has one template per shape.
KERNEL_SOURCE_TEMPLATES: dict[str, str | dict[str, str]] = {
    name: ({shape: op.kernel.source_template(name, shape) for shape in op.kernel.shapes}
           if op.kernel.source_per_shape else op.kernel.source_template(name, ""))
    for name, op in OPERATIONS.items() if op.kernel is not None}


def kernel_source_template(kernel) -> str | None:
    """The template of a kernel's CUDA source (None for an operation without one)."""
    template = KERNEL_SOURCE_TEMPLATES.get(kernel.operation)
    return template.get(kernel.launch.shape) if isinstance(template, dict) else template
