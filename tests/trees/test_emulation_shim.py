"""Build and run the CPU emulation self-test (shim_selftest.cpp beside this file) against the
shipped shim, kv_canary/emulation/cuda_host_shim.h.

The self-test includes cuda_host_shim.h, compiles CUDA-style kernels with g++
and runs them on ucontext fibers; the shim provides only what kv-canary's kernels use, and what
else a kernel might try is a compile error (tested here too).  Skipped when g++ is not installed.
"""
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from support import budget

EMU_DIR = Path(__file__).resolve().parents[2] / "kv_canary" / "emulation"
SELFTEST = Path(__file__).resolve().parent / "shim_selftest.cpp"  # a test: not shipped in the wheel
GXX = shutil.which("g++")

pytestmark = pytest.mark.skipif(GXX is None, reason="g++ not installed")

BASE_FLAGS = ["-std=c++17", "-Wall", "-Wextra", "-Werror"]

EXPECTED_PASSES = [
    "reduction",
    "atomics",
    "shuffles",
    "syncwarp",
    "partial_warp",
    "partial_warp_strict_full_mask",
    "strict_mask_without_self",
    "strict_divergent_kinds",
    "strict_exited_lane",
    "nonstrict_exited_lane",
    "strict_sync_exited",
    "nonstrict_sync_exited",
    "nonstrict_deadlock",
    "strict_deadlock",
    "indices",
    "exception",
    "nested_launch",
    "invalid_config",
    "repeated_launches",
]


def _build(tmp_path: Path, name: str, flags):
    exe = tmp_path / name
    cmd = [GXX, *BASE_FLAGS, *flags, f"-I{EMU_DIR}", str(SELFTEST), "-o", str(exe)]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    return exe, proc


def _run_and_check(exe: Path, env=None):
    proc = subprocess.run([str(exe)], capture_output=True, text=True, timeout=120, env=env)
    out = proc.stdout
    assert proc.returncode == 0, f"self-test failed (rc={proc.returncode}):\n{out}\n{proc.stderr}"
    lines = out.splitlines()
    for name in EXPECTED_PASSES:
        assert f"PASS {name}" in lines, f"missing 'PASS {name}' in:\n{out}"
    assert not any(line.startswith("FAIL") for line in lines), out
    assert lines[-1] == "ALL OK", out
    # The strict-mode messages must name the offending lane clearly.
    assert (
        "strict warp check: lane 5 of warp 0 block 0 named in mask 0xffffffff has exited" in out
    ), out
    return out


def _compiles(tmp_path: Path, statement: str) -> bool:
    """Whether a kernel whose body is `statement` compiles against the shim."""
    source = tmp_path / "kernel.cpp"
    source.write_text(f'#include "cuda_host_shim.h"\n__global__ void k() {{ {statement} }}\n'
                      "int main() { return kvc_emu::launch({1, 1, 1, 32, 1, 1}, k); }\n")
    cmd = [GXX, *BASE_FLAGS, f"-I{EMU_DIR}", "-fsyntax-only", str(source)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).returncode == 0


# The control: what our kernels do compiles in this harness.
def test_what_the_kernels_use_compiles(tmp_path):
    assert _compiles(tmp_path, "unsigned long long v = threadIdx.x; v = __shfl_xor_sync(0xffffffffu, v, 1); "
                               "v += __shfl_up_sync(0xffffffffu, v, 1u) + __shfl_sync(0xffffffffu, v, 0); "
                               "__syncwarp(); __syncthreads(); atomicAdd(&v, 1ull); int i = 0; atomicAdd(&i, 1);")


# A shuffle of a type other than unsigned long long, or with a `width`, does not compile: the shim's
# shuffles move 64-bit lanes of a full warp only, and a silent conversion would emulate another kernel.
@pytest.mark.parametrize("statement", [
    "int v = 1; v = __shfl_xor_sync(0xffffffffu, v, 1);",
    "float v = 1; v = __shfl_sync(0xffffffffu, v, 0);",
    "unsigned long long v = 1; v = __shfl_up_sync(0xffffffffu, v, 1u, 16);",
])
def test_what_the_kernels_do_not_use_does_not_compile(tmp_path, statement):
    assert not _compiles(tmp_path, statement), f"{statement!r} compiled against the shim"


# -O2 is how the emulated backend builds the shim; -O1 (other inlining of the fibers) runs under
# `make test-full`, the sanitizer build below under `make test-full` and `make sanitize`.
@pytest.mark.parametrize("opt", ["-O2", pytest.param("-O1", marks=pytest.mark.skipif(not budget.FULL, reason="under make test-full (KV_CANARY_FULL=1)"))])
def test_selftest(tmp_path, opt):
    exe, proc = _build(tmp_path, f"selftest{opt}", [opt])
    assert proc.returncode == 0, f"compile failed:\n{proc.stderr}"
    _run_and_check(exe)


@pytest.mark.skipif(not (budget.FULL or os.environ.get("KV_CANARY_EMULATION_SANITIZE") == "1"),
                    reason="under make test-full and make sanitize")
def test_selftest_sanitizers(tmp_path):
    # ASan is told about every fiber switch (__sanitizer_start/finish_switch_fiber
    # in the header), so it works with swapcontext; it still prints a one-line
    # "doesn't fully support makecontext/swapcontext" warning on stderr, which
    # is expected.  Skip if this toolchain has no sanitizer runtime.
    exe, proc = _build(
        tmp_path,
        "selftest_asan",
        ["-O1", "-g", "-fsanitize=address,undefined", "-fno-sanitize-recover=undefined"],
    )
    if proc.returncode != 0:
        pytest.skip(f"sanitizer build unavailable: {proc.stderr[-500:]}")
    env = dict(os.environ)
    # Leak checking needs ptrace in some sandboxes; memory errors are the target.
    env["ASAN_OPTIONS"] = "detect_leaks=0:abort_on_error=0"
    env["UBSAN_OPTIONS"] = "print_stacktrace=1"
    _run_and_check(exe, env=env)
