"""Proof without a GPU: every generated kernel and specialisation compiles with NVRTC (the pinned
nvidia-cuda-nvrtc wheel, through CuPy's low-level bindings) for sm_80, sm_90 and sm_100, and with
nvcc -cubin where it is installed (every schema and arch, under `make test-full`). Without the NVRTC
bindings the module skips, except in CI (CI=true) or with KV_CANARY_REQUIRE_NVRTC=1, where it fails."""
from __future__ import annotations

import importlib
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from support import budget

from kv_canary.trees import csrc
from kv_canary.trees import nvrtc as kv_nvrtc
from kv_canary.trees.csrc import CSRC_DIR
from kv_canary.trees.sources import kernel_abi, read_source, tree_dir

ARCHS = (80, 90, 100)
NVCC = shutil.which("nvcc") or ("/usr/local/cuda/bin/nvcc" if Path("/usr/local/cuda/bin/nvcc").exists() else None)
HEADER_INCLUDE = "kv_canary_layout.cuh"

NVRTC_BINDINGS = "cupy_backends.cuda.libs.nvrtc"


def nvrtc_required(environ=os.environ) -> bool:
    """CI installs the pinned wheels, so there a missing or broken binding fails instead of skipping."""
    return environ.get("CI", "").lower() == "true" or environ.get("KV_CANARY_REQUIRE_NVRTC") == "1"


def import_nvrtc_bindings(environ=os.environ):
    """CuPy's NVRTC bindings; skips this module where they are optional, fails where they are required."""
    try:
        return importlib.import_module(NVRTC_BINDINGS)
    except ImportError as exc:
        if nvrtc_required(environ):
            pytest.fail(f"{NVRTC_BINDINGS} cannot be imported ({exc}) but CI=true or KV_CANARY_REQUIRE_NVRTC=1 "
                        f"requires the NVRTC proof: install the pinned cupy-cuda13x and nvidia-cuda-nvrtc wheels",
                        pytrace=False)
        pytest.skip(f"{NVRTC_BINDINGS} is not importable: {exc}", allow_module_level=True)


import_nvrtc_bindings()


@pytest.mark.parametrize("environ,required", [({}, False), ({"CI": "true"}, True), ({"CI": "false"}, False),
                                              ({"KV_CANARY_REQUIRE_NVRTC": "1"}, True)])
def test_missing_bindings_fail_only_where_required(monkeypatch, environ, required):
    monkeypatch.setitem(sys.modules, NVRTC_BINDINGS, None)  # makes the import raise ImportError
    outcome = pytest.fail.Exception if required else pytest.skip.Exception
    with pytest.raises(outcome, match=NVRTC_BINDINGS):
        import_nvrtc_bindings(environ)


def _headers(tree) -> dict:
    return {HEADER_INCLUDE: read_source(tree, kernel_abi(tree).HEADER)}


def _cubin(source: str, name: str, headers: dict, *, arch: int) -> bytes:
    """NVRTC's CUBIN of `source`, through the project's compile cache as the runtime compiles
    (kv_canary/trees/nvrtc.py cached_binary: keyed by NVRTC version, arch, options, source and
    headers): a fresh machine compiles every kernel, a repeated run on it reuses what compiled."""
    return kv_nvrtc.cached_binary(source, name, headers, arch=arch).read_bytes()


def archs_for(tree) -> tuple:
    """Every arch for the default schema; the example schemas for sm_90 unless `make test-full`."""
    import kv_canary
    return ARCHS if budget.FULL or tree is kv_canary.generated else (90,)


@pytest.mark.parametrize("arch", ARCHS)
def test_every_kernel_compiles_with_nvrtc(any_tree, arch):
    if arch not in archs_for(any_tree):
        pytest.skip(f"sm_{arch} for the example schemas runs under make test-full (KV_CANARY_FULL=1)")
    abi = kernel_abi(any_tree)
    assert {k.operation for k in abi.KERNELS.values()} == {"write", "verify", "plan_offsets", "plan_entries", "scatter"}
    for kernel in abi.KERNELS.values():
        cubin = _cubin(read_source(any_tree, kernel.source), kernel.source, _headers(any_tree), arch=arch)
        assert cubin[:4] == b"\x7fELF", f"{kernel.source}: NVRTC did not return a CUBIN"
        for symbol, _ in kernel.variants:  # every specialisation is its own extern "C" entry point
            assert symbol.encode() + b"\0" in cubin, f"{symbol} missing from the sm_{arch} cubin of {kernel.source}"
        for symbol in (abi.ABI_VERSION_SYMBOL, abi.LAYOUT_FINGERPRINT_SYMBOL):
            assert symbol.encode() + b"\0" in cubin, f"ABI symbol {symbol} missing from {kernel.source}"


@pytest.mark.parametrize("shape,threads", [("per_request", 128), ("block_per_request", 32)])
def test_write_compiles_in_every_launch_shape(shape, threads):
    """kernels.yaml's write runs block_per_request; SGLang's per_request and a one-warp block come from
    the same template and must compile too (the block shape's shared memory is a static_assert)."""
    from support.write_shapes import write_shape_tree
    tree = write_shape_tree(shape, threads)
    write = kernel_abi(tree).kernel_for_operation("write")
    assert (write.shape, write.threads) == (shape, threads)
    for arch in ARCHS if budget.FULL else (90,):
        cubin = _cubin(read_source(tree, write.source), write.source, _headers(tree), arch=arch)
        assert cubin[:4] == b"\x7fELF" and write.variants[0][0].encode() + b"\0" in cubin


CHAIN_ONLY = Path(__file__).resolve().parents[2] / "bench" / "chain_only.cu"


def test_chain_only_benchmark_kernel_compiles(any_tree):
    """bench/bench_gpu.py times the prefill write against bench/chain_only.cu, built against the
    tree's header like the generated kernels: it must compile for every arch before a GPU sees it."""
    for arch in archs_for(any_tree):
        cubin = _cubin(CHAIN_ONLY.read_text(encoding="utf-8"), CHAIN_ONLY.name, _headers(any_tree), arch=arch)
        assert cubin[:4] == b"\x7fELF" and b"kv_canary_chain_only\0" in cubin


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
def test_chain_only_benchmark_kernel_compiles_with_nvcc(default_tree, tmp_path):
    out = tmp_path / "chain_only.cubin"
    proc = subprocess.run([NVCC, "-cubin", "-arch=sm_90", "-std=c++17", "-Werror", "all-warnings",
                           f"-I{tree_dir(default_tree) / 'cuda'}", f"-I{CSRC_DIR}", str(CHAIN_ONLY), "-o", str(out)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, f"nvcc failed on {CHAIN_ONLY.name}:\n{proc.stderr}"
    assert out.read_bytes()[:4] == b"\x7fELF"


def test_verify_has_both_expected_token_specialisations(default_tree):
    verify = kernel_abi(default_tree).kernel_for_operation("verify")
    flags = {symbol: dict(values) for symbol, values in verify.variants}
    assert sorted(v["check_verify_expected_token"] for v in flags.values()) == [False, True]
    assert verify.entry_point(check_verify_expected_token=True) != verify.entry_point(check_verify_expected_token=False)


def _nvcc_cases():
    # nvcc is a second compiler beside NVRTC (the runtime's compiler, which covers every kernel and
    # arch above) and slower: `make test-full` builds every schema for every arch with it.
    from support.trees import DEFAULT_SCHEMA, EXAMPLE_SCHEMAS
    if not budget.FULL:
        return [pytest.param(DEFAULT_SCHEMA, 90, marks=pytest.mark.skip(reason="nvcc runs under make test-full"))]
    return [(schema, arch) for schema in (DEFAULT_SCHEMA, *EXAMPLE_SCHEMAS) for arch in ARCHS]


@pytest.mark.skipif(NVCC is None, reason="nvcc is not installed")
@pytest.mark.parametrize("schema,arch", _nvcc_cases(), ids=lambda v: getattr(v, "stem", f"sm_{v}"))
def test_every_kernel_compiles_with_nvcc(schema, arch, tmp_path):
    from support.trees import DEFAULT_SCHEMA, generate_tree

    import kv_canary
    tree = kv_canary.generated if schema == DEFAULT_SCHEMA else generate_tree(schema)
    cuda_dir = tree_dir(tree) / "cuda"
    for kernel in kernel_abi(tree).KERNELS.values():
        out = tmp_path / f"{kernel.name}.cubin"
        proc = subprocess.run([NVCC, "-cubin", f"-arch=sm_{arch}", "-std=c++17", "-Werror", "all-warnings",
                               f"-I{cuda_dir}", f"-I{CSRC_DIR}", str(tree_dir(tree) / kernel.source), "-o", str(out)],
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, f"nvcc failed on {kernel.source} for sm_{arch}:\n{proc.stderr}"
        assert out.read_bytes()[:4] == b"\x7fELF"


def test_compile_error_names_the_template_line(default_tree):
    """A compile error quotes the NVRTC log, which points at the template through #line."""
    source = read_source(default_tree, "cuda/canary_verify.cu")
    match = re.search(r'#line (\d+) "(codegen/templates/cuda/verify\.cu\.j2)"\n', source)
    assert match, "generated verify source carries no #line directive"
    broken = source[:match.end()] + "this_is_not_cuda;\n" + source[match.end():]
    with pytest.raises(kv_nvrtc.CudaCompileError) as err:
        kv_nvrtc.compile_source(broken, "canary_verify.cu", _headers(default_tree), arch=90)
    text = str(err.value)
    assert f"{match.group(2)}({match.group(1)})" in text, text
    assert "this_is_not_cuda" in text and "error" in text
    assert "canary_verify.cu" in text and "sm_90" in text


def test_compile_cache_is_project_owned_and_keyed_by_content(default_tree, tmp_path, monkeypatch):
    monkeypatch.setenv("KV_CANARY_CACHE_DIR", str(tmp_path / "cache"))
    source = read_source(default_tree, "cuda/canary_scatter_req_token_ids.cu")
    first = kv_nvrtc.cached_binary(source, "scatter.cu", _headers(default_tree), arch=80)
    assert first.parent == tmp_path / "cache" / "cuda" and first.suffix == ".cubin"
    stamp = first.stat().st_mtime_ns
    again = kv_nvrtc.cached_binary(source, "scatter.cu", _headers(default_tree), arch=80)
    assert again == first and again.stat().st_mtime_ns == stamp  # a hit: not rebuilt
    other_arch = kv_nvrtc.cached_binary(source, "scatter.cu", _headers(default_tree), arch=90)
    edited = kv_nvrtc.cached_binary(source + "\n// edited\n", "scatter.cu", _headers(default_tree), arch=80)
    other_header = kv_nvrtc.cached_binary(source, "scatter.cu",
                                          {HEADER_INCLUDE: _headers(default_tree)[HEADER_INCLUDE] + "\n"}, arch=80)
    assert len({first, other_arch, edited, other_header}) == 4
    assert not list(Path.cwd().glob("*.cubin"))


def test_compile_cache_covers_the_csrc_headers(default_tree, tmp_path, monkeypatch):
    """An edited kv_canary/csrc/ header changes the cache key: the kernels that include it recompile."""
    monkeypatch.setenv("KV_CANARY_CACHE_DIR", str(tmp_path / "cache"))
    source = read_source(default_tree, "cuda/canary_scatter_req_token_ids.cu")
    first = kv_nvrtc.cached_binary(source, "scatter.cu", _headers(default_tree), arch=80)
    copy = tmp_path / "csrc"
    shutil.copytree(CSRC_DIR, copy)
    monkeypatch.setattr(csrc, "CSRC_DIR", copy)
    assert kv_nvrtc.cached_binary(source, "scatter.cu", _headers(default_tree), arch=80) == first
    scatter = copy / "kvc_scatter.cuh"
    scatter.write_text(scatter.read_text(encoding="utf-8") + "// edited\n", encoding="utf-8")
    assert kv_nvrtc.cached_binary(source, "scatter.cu", _headers(default_tree), arch=80) != first


def test_ptx_only_inside_the_portable_load_helper(any_tree):
    """Inline PTX appears once, in the csrc helper with a host variant; no standard headers for NVRTC."""
    device = csrc.csrc_headers()
    assert sum(text.count("asm(") for text in device.values()) == 1
    helper = device["kvc_device.cuh"][device["kvc_device.cuh"].index("load_u64x2"):]
    assert helper.index("#if defined(KV_CANARY_HOST_EMULATION)") < helper.index("#else") < helper.index("asm(")
    header = read_source(any_tree, kernel_abi(any_tree).HEADER)
    for name, text in [(k.source, read_source(any_tree, k.source)) for k in kernel_abi(any_tree).KERNELS.values()] + [
            (name, text) for name, text in device.items() if name.endswith(".cuh")] + [("layout header", header)]:
        assert "asm(" not in text or name == "kvc_device.cuh", name
        assert "#include <" not in text, name
    assert "typedef unsigned long long" in device["kvc_types.cuh"] and '#include "kvc_types.cuh"' in header


def test_target_for_device_falls_back_to_ptx_for_unknown_arch():
    archs = kv_nvrtc.supported_archs()
    assert kv_nvrtc.target_for(90) == (90, True)
    newest = max(archs)
    assert kv_nvrtc.target_for(newest + 1) == (newest, False)
    with pytest.raises(kv_nvrtc.CudaCompileError):
        kv_nvrtc.target_for(min(archs) - 1)
