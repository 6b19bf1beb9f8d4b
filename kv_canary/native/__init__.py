"""kv-canary's native launch signer (signing.cpp): built with g++ on first use, cached by content.

A cached launch is keyed on the signature of its arguments (kv_canary/signature.py). Read through
torch's Python accessors that costs about a microsecond per tensor, most of a repeated launch's host
time; the native signer reads the same fields from the TensorImpl in one C call per launch.

KV_CANARY_NATIVE chooses:
- `auto` (the default): use the signer, building it on a cache miss (a few seconds, once per
  machine and torch); where it cannot be built or fails its self-check (no g++, no Python headers,
  a torch whose tensors it cannot read), warn once on the `kv_canary` logger and sign in Python;
- `1`: the same, but a failure is an error (ImportError naming the reason);
- `0`: always sign in Python.
Both signers give the launch path the same guarantees; they differ only in speed. `status()` says
which one this process uses and why.

The build needs g++, Python's headers and torch's headers (shipped in the torch wheel); the cache key
covers the source, the flags, the compiler, the Python ABI and the torch version, so another torch
gets its own build (and every venv of one torch version shares one).
"""
from __future__ import annotations

import functools
import importlib.util
import logging
import os
import subprocess
import sys
import sysconfig
from pathlib import Path
from typing import Optional

from ..cache import cache_dir, content_key, entry

ENV_NATIVE = "KV_CANARY_NATIVE"
SOURCE = Path(__file__).resolve().parent / "signing.cpp"
MODULE = "_signing"  # PyInit__signing in signing.cpp
CXX_FLAGS = ("-std=c++20", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-w")
logger = logging.getLogger("kv_canary")


class NativeBuildError(RuntimeError):
    """The native signer could not be built or loaded; the message says why."""


def mode() -> str:
    value = os.environ.get(ENV_NATIVE, "auto").strip().lower() or "auto"
    if value not in ("auto", "0", "1"):
        raise ValueError(f"kv-canary: {ENV_NATIVE}={value!r} is not a choice; expected auto, 1 or 0")
    return value


def _torch_paths():
    import torch
    root = Path(torch.__file__).resolve().parent
    return torch, root / "include", root / "lib"


def _direct_impl(version: str) -> bool:
    """Whether this torch keeps a plain at::Tensor in its Python tensor object (2.10 on; before, a
    MaybeOwned), so that signing.cpp reads the TensorImpl's address there instead of `_cdata`."""
    try:
        major, minor = (int(part) for part in version.split("+")[0].split(".")[:2])
    except ValueError:
        return False
    return (major, minor) >= (2, 10)


def build() -> Path:
    """Path of the built extension, compiling it on a cache miss; NativeBuildError says why not."""
    from ..emulation.build import SANITIZE_FLAGS, EmulationBuildError, compiler, sanitize_enabled
    try:
        gxx, version = compiler()
    except (EmulationBuildError, OSError, subprocess.SubprocessError) as exc:
        raise NativeBuildError(str(exc)) from None
    torch, include, lib = _torch_paths()
    python_include = sysconfig.get_paths()["include"]
    for header in (Path(python_include) / "Python.h", include / "c10" / "core" / "TensorImpl.h"):
        if not header.is_file():
            raise NativeBuildError(f"kv-canary: the native signer needs {header}, which is not installed")
    abi = f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"
    direct = f"-DKV_CANARY_DIRECT_IMPL={int(_direct_impl(torch.__version__))}"
    suffix = sysconfig.get_config_var("EXT_SUFFIX") or ".so"
    source = SOURCE.read_text(encoding="utf-8")
    # Under `make sanitize` (the emulation's variable) the signer is instrumented too, its own entry.
    flags = CXX_FLAGS + SANITIZE_FLAGS if sanitize_enabled() else CXX_FLAGS
    # Not the install path: venvs with the same torch share one build (its headers are the version's).
    key = content_key("kv-canary-native-1", source, " ".join(flags), abi, direct, version, suffix, torch.__version__)
    out = cache_dir("native") / f"kv_canary_signing_{'asan_ubsan_' if sanitize_enabled() else ''}{key[:32]}{suffix}"

    def compile_to(tmp: Path) -> None:
        cmd = [gxx, *flags, abi, direct, f"-I{python_include}", f"-I{include}", str(SOURCE), f"-L{lib}", "-lc10",
               f"-Wl,-rpath,{lib}", "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise NativeBuildError(f"kv-canary: g++ could not build the native signer from {SOURCE}:\n"
                                   f"{proc.stderr.strip()[-4000:]}\ncommand: {' '.join(cmd)}")
    return entry(out, compile_to)


def load(path: Path):
    """Import the built extension (a module named _signing, not entered in sys.modules)."""
    spec = importlib.util.spec_from_file_location(MODULE, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def self_check(module) -> None:
    """The signer reads what torch's Python accessors read, on tensors whose pointer, shape and
    strides differ in every way a launch's checks look at; NativeBuildError where it does not."""
    import torch
    base = torch.arange(24, dtype=torch.int64).view(4, 6)
    for t in (base, base[1:], base.t(), base[:, 2:3], torch.zeros(0, dtype=torch.int32), torch.zeros(()), base.view(24)):
        if module.impl_address(t) != t._cdata:
            raise NativeBuildError(f"kv-canary: the native signer finds a tensor's TensorImpl at "
                                   f"{module.impl_address(t):#x}, torch says {t._cdata:#x}: its Python tensor "
                                   f"layout is not the one signing.cpp was built for (torch {torch.__version__})")
        got = module.tensor_fields(t)
        index = -1 if t.device.index is None else t.device.index
        want = (t.data_ptr(), got[1], index, tuple(t.shape), t.stride())
        if got != want:
            raise NativeBuildError(f"kv-canary: the native signer reads {got} from a tensor whose (data_ptr, device type, "
                                   f"device index, shape, strides) are {want}: it does not match this torch "
                                   f"({torch.__version__})")


@functools.lru_cache(maxsize=1)
def signer() -> tuple[Optional[object], str]:
    """(the configured native module or None, what this process signs with and why)."""
    chosen = mode()
    if chosen == "0":
        return None, f"python ({ENV_NATIVE}=0)"
    try:
        from ..signature import configure_native
        module = load(build())
        configure_native(module)
        self_check(module)
        return module, f"native ({SOURCE.name}, torch {sys.modules['torch'].__version__})"
    except Exception as exc:  # any failure: the Python signer is always there
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        if chosen == "1":
            raise ImportError(f"kv-canary: {ENV_NATIVE}=1 but the native signer is unavailable: {exc}") from exc
        logger.warning("kv-canary: the native launch signer is unavailable (%s); launches sign their arguments in "
                       "Python, tens of microseconds more per launch (set %s=0 to choose this silently)", reason,
                       ENV_NATIVE)
        return None, f"python (native unavailable: {reason})"


def status() -> str:
    """Which signer this process uses and why (for benchmarks and reports)."""
    return signer()[1]
