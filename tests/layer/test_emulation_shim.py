"""Build and run the CPU emulation self-test (shim_selftest.cpp beside this file) against the
shipped shim, kv_canary/emulation/cuda_host_shim.h.

The self-test includes cuda_host_shim.h, compiles CUDA-style kernels with g++
and runs them on ucontext fibers.  Skipped when g++ is not installed.
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
    "ballot_popc",
    "shfl_xor_butterfly",
    "partial_warp",
    "partial_warp_strict_full_mask",
    "strict_exited_lane",
    "nonstrict_exited_lane",
    "strict_sync_exited",
    "nonstrict_sync_exited",
    "nonstrict_deadlock",
    "strict_deadlock",
    "dims_2d",
    "trap",
    "invalid_config",
    "repeated_launches",
    "host_helpers",
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
