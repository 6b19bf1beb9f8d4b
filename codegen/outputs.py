"""The table of generated files: which template renders which file of generated/.

Adding a generated file = adding a template under templates/ and a row here.
"""
from __future__ import annotations

# (template, output path relative to generated/), rendered once each, in this order.
STATIC_OUTPUTS = (
    ("python/__init__.py.j2", "__init__.py"),
    ("python/layout.py.j2", "layout.py"),
    ("docs/LAYOUT.md.j2", "LAYOUT.md"),
)

# kernels.yaml `template:` name -> the Jinja template of that kernel's CUDA source, rendered once
# per kernel into cuda/<kernel name>.cu with `kernel` in its context.
KERNEL_SOURCE_TEMPLATES: dict[str, str] = {}
