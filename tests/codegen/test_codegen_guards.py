"""Guards between the schema checker and what the generated code can compile or compute.

- every name the generated Python layout declares beside the schema's own names is reserved by
  codegen/checks.py (so a schema name never shadows it; C and C++ need no such list, see
  tests/codegen/test_c_names.py);
- the write kernel's shared-memory bound in checks.py is the compiler's: the largest accepted
  thread count compiles, one warp more fails the kernel's static_assert;
- splitmix64 refuses inputs it would silently hash wrong; generated files get ordinary modes;
  tests/support/trees.py's temporary trees are removed when the process exits.
"""
from __future__ import annotations

import ast
import dataclasses
import os
import re
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from kv_canary.codegen import checks
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.load import load_schema, load_schema_text
from kv_canary.codegen.model import STATIC_SHARED_MEMORY_BYTES, block_per_request_shared_memory
from kv_canary.codegen.render import render_all, split_header
from kv_canary.codegen.writer import write_tree
from support.trees import DEFAULT_SCHEMA, default_schema_text

ROOT = Path(__file__).resolve().parents[2]


def _bodies(schema) -> dict[str, str]:
    return {f.path: split_header(f.text)[1] for f in render_all(schema, DEFAULT_SCHEMA.read_text(encoding="utf-8"))}


def _schema_names(schema) -> set[str]:
    """Names the checker already derives from (or takes from) the schema itself."""
    names = set(checks._generated_names(schema))
    names |= {c.name for c in schema.constants} | {vs.name for vs in schema.flags + schema.enums}
    return names


# -- reserved Python names stay in step with the templates -------------------------------------
def test_every_module_name_of_layout_py_is_reserved():
    schema = load_schema(DEFAULT_SCHEMA)
    tree = ast.parse(_bodies(schema)["layout.py"])
    declared = set()
    for node in tree.body:
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            declared.add(node.name)
        elif isinstance(node, ast.Assign):
            declared |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, (ast.Import, ast.ImportFrom)):
            declared |= {(a.asname or a.name).split(".")[0] for a in node.names}
    assert {"splitmix64", "ABI_VERSION", "FailReason", "enum"} <= declared
    unreserved = {n for n in declared if not n.startswith("_")} - checks.LAYOUT_FIXED_NAMES - \
        checks.RESERVED_NAMES - _schema_names(schema)
    assert not unreserved, (f"generated/layout.py defines {sorted(unreserved)}: add them to LAYOUT_FIXED_NAMES in "
                            f"codegen/checks.py so a schema name cannot shadow them")


# -- the write kernel's shared memory: checks.py and the compiler agree --------------------------
def _wide_record_text(n_fields: int, threads: int) -> str:
    """kernels.yaml with n_fields canary fields (reserved padding) and a block_per_request write."""
    pad = "".join(f"      - {{name: pad{i}, role: reserved}}\n" for i in range(n_fields - 4))
    text = default_schema_text(stride=8 * n_fields)
    anchor = "      - {name: real_kv_hash, role: kv_fingerprint}\n"
    assert text.count(anchor) == 1
    text = text.replace(anchor, anchor + pad)
    text, n = re.subn(r"(operation: write\n\s*launch: )\{[^}]*\}",
                      rf"\g<1>{{shape: block_per_request, threads: {threads}}}", text)
    assert n == 1
    return text


def _largest_accepted(n_fields: int) -> int:
    accepted = 0
    for threads in range(32, 1025, 32):
        try:
            load_schema_text(_wide_record_text(n_fields, threads))
            accepted = threads
        except SchemaError as exc:
            assert "static shared memory" in str(exc), str(exc)
    return accepted


@pytest.mark.parametrize("n_fields, want", [
    # Two buffers of (threads - 32) staged Entries of 8 * (fields + 3) bytes (warp 0 walks and stages
    # nothing), plus one 32-row tile of 16-byte chunks per staging warp (the arithmetic of
    # write.cu.j2's structs, worked by hand):
    (4, 352),    # 2 * 320 * 56 + 10 * 1024 = 46080; 384 threads: 39424 + 11 * 1024 = 50688
    (16, 160),   # 2 * 128 * 152 + 4 * 2560 = 49152 (4-chunk slices): exactly 48 KiB; 192: 48640 + 5 * 1024
    (32, 96),    # 2 * 64 * 280 + 2 * 4608 = 45056 (8-chunk slices); 128 threads: 53760 + 3 * 1024
    (64, 64),    # 2 * 32 * 536 + 1 * 4608 = 38912; 96 threads: 68608 + 2 * 1024
])
def test_block_per_request_thread_bound(n_fields, want):
    assert _largest_accepted(n_fields) == want


def test_shared_memory_error_names_the_threads_and_the_fix():
    text = _wide_record_text(32, 256)
    with pytest.raises(SchemaError) as err:
        load_schema_text(text)
    lines = text.splitlines()
    line = next(i for i, s in enumerate(lines) if "shape: block_per_request, threads: 256" in s) + 1
    col = lines[line - 1].index("256") + 1
    assert str(err.value) == (
        f"kernels.yaml:{line}:{col}: error: kernel 'canary_write' launch shape 'block_per_request' needs 132608 bytes "
        f"of static shared memory with 256 threads (2 x 224 staged entries of 280 bytes for the 32-field record + 7 "
        f"warp tiles of 1024 bytes), more than the {STATIC_SHARED_MEMORY_BYTES} a block may declare; use at most "
        f"96 threads")


def _write_sources(schema) -> tuple[str, str, dict[str, str]]:
    write = schema.kernels_by_operation("write")[0]
    files = {f.path: f.text for f in render_all(schema, "")}
    return write.name, files[f"cuda/{write.name}.cu"], {"kv_canary_layout.cuh": files["cuda/kv_canary_layout.cuh"]}


def test_the_compiler_agrees_with_the_shared_memory_bound():
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC bindings (cupy-cuda13x) not installed")
    from kv_canary.trees import nvrtc
    schema = load_schema_text(_wide_record_text(32, 96))  # the most threads checks.py accepts
    name, source, headers = _write_sources(schema)
    assert nvrtc.cached_binary(source, f"{name}.cu", headers, arch=90).read_bytes()[:4] == b"\x7fELF"  # cached by content
    # One warp more, past the checker (it would refuse this schema): the kernel's own assert fires.
    write = schema.kernels_by_operation("write")[0]
    wider = dataclasses.replace(write, launch=dataclasses.replace(write.launch, threads=128))
    assert not block_per_request_shared_memory(schema.canary, 128).fits
    name, source, headers = _write_sources(dataclasses.replace(
        schema, kernels=tuple(wider if k is write else k for k in schema.kernels)))
    with pytest.raises(nvrtc.CudaCompileError, match=f"static shared memory of {name}"):
        nvrtc.compile_source(source, f"{name}.cu", headers, arch=90)


# -- splitmix64 takes Python ints (and numpy integer scalars), nothing it would hash wrong -------
def test_splitmix64_accepts_ints_and_numpy_integer_scalars(default_tree):
    sm, mix3 = default_tree.layout.splitmix64, default_tree.layout.splitmix64_mix3
    big = 0xFEDCBA9876543210
    assert sm(np.uint64(big)) == sm(big)
    assert sm(np.int64(-1)) == sm(-1) == sm((1 << 64) - 1)
    assert sm(np.int32(7)) == sm(7)
    assert mix3(np.uint64(big), np.int64(-2), 3) == mix3(big, -2, 3)
    assert type(sm(np.uint64(5))) is int


@pytest.mark.parametrize("value", [torch.tensor(5), torch.tensor([1, 2]), np.array([5], dtype=np.uint64),
                                   np.array(5), 5.0, "5", True, None])
def test_splitmix64_refuses_what_it_would_hash_wrong(default_tree, value):
    import kv_canary
    for fn in (default_tree.layout.splitmix64, kv_canary.splitmix64):
        with pytest.raises(TypeError, match=rf"^x must be a Python int or a numpy integer scalar, got "
                                            rf"{type(value).__name__}$"):
            fn(value)
    for position, arg in enumerate("abc"):
        args = [1, 2, 3]
        args[position] = value
        with pytest.raises(TypeError, match=rf"^{arg} must be a Python int .*got {type(value).__name__}$"):
            kv_canary.splitmix64_mix3(*args)


# -- file modes ---------------------------------------------------------------------------------
@pytest.fixture
def umask():
    def set_mask(mask: int) -> None:
        os.umask(mask)
    old = os.umask(0o022)
    yield set_mask
    os.umask(old)


def test_generated_files_get_the_mode_of_any_new_file(tmp_path, umask):
    files = render_all(load_schema(DEFAULT_SCHEMA), DEFAULT_SCHEMA.read_text(encoding="utf-8"))
    for mask, want in ((0o022, 0o644), (0o027, 0o640)):
        umask(mask)
        out = tmp_path / f"gen_{mask:o}"
        write_tree(out, files)
        modes = {p.relative_to(out).as_posix(): stat.S_IMODE(p.stat().st_mode) for p in out.rglob("*") if p.is_file()}
        assert modes and set(modes.values()) == {want}, modes
    umask(0o022)
    victim = tmp_path / "gen_22" / "layout.py"
    victim.chmod(0o600)  # as an older generator left it
    assert write_tree(tmp_path / "gen_22", files) == ([], [])  # nothing rewritten...
    assert stat.S_IMODE(victim.stat().st_mode) == 0o644  # ...but the mode is repaired


# -- tests/support/trees.py cleans up after itself -------------------------------------------------------
def test_temporary_generated_trees_are_removed_at_exit(tmp_path):
    script = ("import sys; sys.path.insert(0, sys.argv[1]); from support import trees; "
              "tree = trees.generate_tree(trees.EXAMPLE_SCHEMAS[0]); "
              "print(trees._gen_root()); print(trees.scratch_dir('kv_canary_probe_'))")
    proc = subprocess.run([sys.executable, "-c", script, str(ROOT / "tests")], cwd=tmp_path, capture_output=True,
                          text=True, timeout=120, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert proc.returncode == 0, proc.stderr
    made = [Path(line) for line in proc.stdout.split()]
    assert len(made) == 2 and all(p.is_absolute() for p in made)
    assert not any(p.exists() for p in made), made
