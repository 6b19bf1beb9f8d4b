"""Schemas, generated trees and the golden vectors the tests share (the fixtures over them are in
tests/conftest.py)."""
from __future__ import annotations

import atexit
import functools
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

from kv_canary.trees import schemas as trees

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_SCHEMA = ROOT / "kernels.yaml"
EXAMPLE_SCHEMAS = sorted(trees.SCHEMAS_DIR.glob("*.yaml"))
# The golden vectors of docs/semantics.md §10 live in the repository (tests/spec/vectors.json);
# KV_CANARY_SPEC_DIR points the tests at another copy (e.g. a newer contract's).
SPEC_DIR = Path(os.environ.get("KV_CANARY_SPEC_DIR", ROOT / "tests" / "spec"))


def scratch_dir(prefix: str) -> Path:
    """A fresh temporary directory, removed when the test process exits."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    return path


@functools.cache
def _gen_root() -> Path:
    return scratch_dir("kv_canary_gen_")


def default_schema_text(*, stride: int | None = None, abi_version: int | None = None) -> str:
    """kernels.yaml's text, optionally with another canary slot stride and/or abi_version.

    Tests that derive a mutated schema start from here, so they keep working whatever stride and
    abi_version the checked-in schema uses (the schema-change workflow: edit kernels.yaml, bump
    abi_version as `make abi-check` demands, `make generate`, and `make test` must stay green).
    """
    text = DEFAULT_SCHEMA.read_text(encoding="utf-8")
    if stride is not None:
        text, n = re.subn(r"(?m)^(\s*slot_stride_bytes:\s*)\d+", rf"\g<1>{stride}", text)
        assert n == 1, "kernels.yaml must declare exactly one slot_stride_bytes"
    if abi_version is not None:
        text, n = re.subn(r"(?m)^abi_version:[ \t]*\d+", f"abi_version: {abi_version}", text)
        assert n == 1, "kernels.yaml must declare exactly one top-level abi_version"
    return text


def sglang_schema_text() -> str:
    """kernels.yaml normalised to SGLang's default ABI (stride 32, abi_version 1): the fixed base of
    tests that spell out exact offsets, strides or abi_versions."""
    return default_schema_text(stride=32, abi_version=1)


def load_vectors() -> dict:
    """The golden vectors (docs/semantics.md §10); a missing file is an error, never a silent skip."""
    path = SPEC_DIR / "vectors.json"
    if not path.is_file():
        raise FileNotFoundError(f"golden vectors not found at {path}: tests/spec/vectors.json is part of the "
                                f"checkout; KV_CANARY_SPEC_DIR names another directory holding vectors.json")
    return json.loads(path.read_text(encoding="utf-8"))


def generate_tree(schema_path: Path):
    """Generate `schema_path` into this test session's scratch cache (never checked in) and import it."""
    return trees.generate_tree(schema_path, _gen_root())


def files_changed_by(old: str, new: str) -> int:
    """How many generated files the schema edit `old` -> `new` changes (what `check` lists for it).
    Only the identity file, __init__.py, carries the schema hash; the others change with their text."""
    from kv_canary.codegen.load import load_schema_text
    from kv_canary.codegen.render import render_all

    before, after = (render_all(load_schema_text(text), text) for text in (old, new))
    return sum(a.text != b.text for a, b in zip(before, after, strict=True))
