"""Generated trees of other schemas: render a schema into a cached tree and import it. The cache key
is the schema's text and the generator's own hash; a tree is written to a temporary directory and
renamed into place, so concurrent processes never import half a tree.
"""
from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path
from types import ModuleType

from . import cache
from .loader import PACKAGE_DIR, load_generated, register_codegen

SCHEMAS_DIR = PACKAGE_DIR / "schemas"  # the example schemas, shipped as package data


def example_schema(name: str) -> Path:
    """Path of a shipped example schema (`owner_epoch`, `wide_stride`)."""
    path = SCHEMAS_DIR / f"{name}.yaml"
    if not path.is_file():
        known = ", ".join(sorted(p.stem for p in SCHEMAS_DIR.glob("*.yaml")))
        raise ValueError(f"kv-canary: no example schema named {name!r}; known: {known}")
    return path


def generate_tree(schema: Path | str, cache_dir: Path | str | None = None) -> ModuleType:
    """Generate `schema` (a kernels.yaml-format file) into a cached tree (default under
    `<kv-canary cache>/trees`) and import it; a bad schema raises SchemaError (every diagnostic)."""
    register_codegen()
    from ..codegen.load import load_schema_bytes
    from ..codegen.render import generator_sha256, render_all
    from ..codegen.writer import write_tree

    schema = Path(schema)
    raw = schema.read_bytes()
    key = cache.content_key("kv-canary-tree-1", raw, generator_sha256())[:16]
    root = Path(cache_dir) if cache_dir is not None else cache.cache_dir("trees")
    stem = "".join(c if c.isalnum() else "_" for c in schema.stem)[:40]
    out = root / f"{stem}_{key}"
    if not (out / "__init__.py").is_file():
        files = render_all(load_schema_bytes(raw, schema.name), raw.decode("utf-8"))
        root.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=root))
        try:
            write_tree(tmp, files)
            try:
                os.rename(tmp, out)
            except OSError:
                if not (out / "__init__.py").is_file():  # not a concurrent winner: a real failure
                    raise
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return load_generated(out, f"kv_canary_tree_{stem}_{key}")
