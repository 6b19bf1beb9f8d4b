"""`make sanitize`: the bad-runtime-input tests against ASan+UBSan builds of the emulation library and
of the cpu backend's library (kv_canary/trees/cpu_build.py builds its own instrumented variant under
the same switch).

Usage: python scripts/sanitize.py [pytest arguments...]   (the Makefile passes SANITIZE_TESTS)

The emulation library is built with -fsanitize=address,undefined -fno-sanitize-recover=all (its own
cache entry: kv_canary/trees/sanitize.py, KV_CANARY_EMULATION_SANITIZE=1) and loaded into a python
that has the sanitizer runtimes preloaded, so any out-of-bounds access, use-after-free or undefined
behaviour (signed overflow, misaligned access, bad shift, ...) in the generated kernels or the shim
aborts the run with the sanitizer's report. Before the tests, a positive control proves that this
setup does catch a signed overflow in a ctypes-loaded library. The differential tests run at a small
budget (KV_CANARY_CASES, default 0.1). Prints the number of findings; exits non-zero on any finding
or test failure.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FINDING = re.compile(r"ERROR: AddressSanitizer|runtime error:|ERROR: LeakSanitizer")
CONTROL_SOURCE = 'extern "C" __attribute__((visibility("default"))) int kvc_sanitize_control(int x) { return x + 1; }\n'


def runtime(gxx: str, name: str) -> str:
    path = subprocess.run([gxx, f"-print-file-name={name}"], capture_output=True, text=True, check=True).stdout.strip()
    if not os.path.isabs(path) or not os.path.exists(path):
        sys.exit(f"sanitize: {gxx} has no {name} (install the gcc sanitizer runtimes, e.g. libasan8 libubsan1)")
    return path


def sanitizer_env(gxx: str) -> dict:
    env = dict(os.environ)
    env.update(
        LD_PRELOAD=" ".join([runtime(gxx, "libasan.so"), runtime(gxx, "libubsan.so"), env.get("LD_PRELOAD", "")]).strip(),
        # Python itself is not instrumented: leaks are its own; fibers switch stacks (the shim tells ASan);
        # a huge allocation (a test of the allocators' error) returns NULL to torch instead of aborting.
        ASAN_OPTIONS="detect_leaks=0:halt_on_error=1:abort_on_error=0:detect_stack_use_after_return=0:"
                     "allocator_may_return_null=1",
        UBSAN_OPTIONS="print_stacktrace=1:halt_on_error=1",
        KV_CANARY_EMULATION_SANITIZE="1",
        KV_CANARY_CASES=env.get("KV_CANARY_CASES", "0.1"),
        PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p),
    )
    return env


def positive_control(gxx: str, env: dict) -> None:
    """A library with a signed overflow, built with the same sanitizer flags: loading and calling it
    in this setup must abort with UBSan's report, or the real run would prove nothing."""
    sys.path.insert(0, str(ROOT))
    from kv_canary.trees.emulation_build import CXX_FLAGS
    from kv_canary.trees.sanitize import SANITIZE_FLAGS
    with tempfile.TemporaryDirectory(prefix="kv_canary_sanitize_") as tmp:
        src, lib = Path(tmp) / "control.cpp", Path(tmp) / "control.so"
        src.write_text(CONTROL_SOURCE)
        subprocess.run([gxx, *CXX_FLAGS, *SANITIZE_FLAGS, str(src), "-o", str(lib)], check=True)
        call = f"import ctypes; ctypes.CDLL({str(lib)!r}).kvc_sanitize_control(2**31 - 1)"
        proc = subprocess.run([sys.executable, "-c", call], env=env, capture_output=True, text=True, timeout=120)
    if proc.returncode == 0 or "runtime error: signed integer overflow" not in proc.stderr:
        sys.exit(f"sanitize: the positive control was not caught (exit {proc.returncode}); the sanitizer setup is "
                 f"broken:\n{proc.stderr[-2000:]}")
    print("sanitize: positive control caught (signed integer overflow in a ctypes-loaded library)", flush=True)


def main(argv: list[str]) -> int:
    gxx = shutil.which("g++")
    if gxx is None:
        sys.exit("sanitize: g++ is not installed")
    env = sanitizer_env(gxx)
    positive_control(gxx, env)
    # --capture=sys: pytest captures Python's streams only, so a sanitizer's report (written to file
    # descriptor 2 just before it ends the process) reaches this script instead of a capture file.
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--capture=sys", *argv]
    print(f"sanitize: {' '.join(cmd)}  (KV_CANARY_CASES={env['KV_CANARY_CASES']})", flush=True)
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    findings = 0
    for line in proc.stdout:
        sys.stdout.write(line)
        findings += bool(FINDING.search(line))
    rc = proc.wait()
    print(f"sanitize: {findings} sanitizer finding(s); pytest exit status {rc}", flush=True)
    return 1 if findings or rc else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
