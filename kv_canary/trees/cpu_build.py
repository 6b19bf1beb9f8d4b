"""Build the native cpu library of a generated tree with the system compiler, cached by content.

One translation unit: the generated cpu/kv_canary_cpu.cpp includes kv_canary/csrc/kvc_cpu.h, which
includes the tree's layout header (cuda/, on the include path) and the hand-written device headers.
Compiled for this host (-O3 -march=native): the cache key covers the compiler, the flags, this CPU's
model and instruction-set flags (a cache directory shared with another machine never hands it a
library built for other instructions) and the text of every input, so an edited header, template
or schema rebuilds and an unchanged tree is built once per machine.

$CXX names the compiler (default g++). With KV_CANARY_EMULATION_SANITIZE=1 (`make sanitize`) the
library is built with AddressSanitizer and UndefinedBehaviorSanitizer, as the emulation library is
(kv_canary/trees/sanitize.py), as its own cache entry.
"""
from __future__ import annotations

import functools
import os
import shutil
import subprocess
from pathlib import Path

from .cache import cache_dir, content_key, entry
from .csrc import CSRC_DIR, csrc_headers
from .sanitize import build_flags
from .sources import kernel_abi, read_source, tree_dir

ENV_CXX = "CXX"
CXX_FLAGS = ("-std=c++17", "-O3", "-march=native", "-shared", "-fPIC", "-fvisibility=hidden", "-pthread",
             "-Wall", "-Wextra", "-Wno-unknown-pragmas", "-Werror", "-Wl,--no-undefined")


class CpuBuildError(RuntimeError):
    """No compiler, or it rejected the generated sources; the message says which and quotes it."""


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str]:
    """(path, version line) of the C++ compiler ($CXX, else g++), or raise when there is none."""
    name = os.environ.get(ENV_CXX) or "g++"
    path = shutil.which(name)
    if path is None:
        raise CpuBuildError(f"kv-canary: the cpu backend needs a C++ compiler ({ENV_CXX} or g++ on PATH), found no {name!r}")
    proc = subprocess.run([path, "--version"], capture_output=True, text=True)
    if proc.returncode != 0 or not proc.stdout:
        raise CpuBuildError(f"kv-canary: the C++ compiler {path} does not run (`{path} --version` exited "
                            f"{proc.returncode}): {proc.stderr.strip()[:500]}")
    return path, proc.stdout.splitlines()[0]


@functools.lru_cache(maxsize=1)
def host_cpu() -> str:
    """This CPU's model and instruction-set flags (what -march=native compiles for), for the cache key."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        import platform
        return platform.processor() or platform.machine()
    keep = ("model name", "flags", "Features", "CPU part", "isa")
    seen: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        key = key.strip()
        if key in keep and key not in seen:
            seen[key] = value.strip()
    return "; ".join(f"{k}: {seen[k]}" for k in sorted(seen))


def library_inputs(tree) -> list[tuple[str, str]]:
    """(name, text) of every file the library is built from, in a fixed order."""
    abi = kernel_abi(tree)
    return list(csrc_headers().items()) + [(name, read_source(tree, name)) for name in (abi.CPU_SOURCE, abi.HEADER)]


def build_library(tree) -> Path:
    """Path of the tree's cpu library, compiling it on a cache miss."""
    abi = kernel_abi(tree)
    if not hasattr(abi, "CPU_SOURCE"):
        raise CpuBuildError(f"kv-canary: generated tree {tree.__name__} has no cpu source (generated before the "
                            f"cpu backend existed); regenerate it")
    cxx, version = compiler()
    flags, sanitized = build_flags(CXX_FLAGS, library="cpu", error=CpuBuildError)
    inputs = library_inputs(tree)
    key = content_key("kv-canary-cpu-1", version, " ".join(flags), host_cpu(),
                      *(part for name, text in inputs for part in (name, text)))
    out = cache_dir("cpu") / f"kv_canary_cpu_{'asan_ubsan_' if sanitized else ''}{key[:32]}.so"
    folder = tree_dir(tree)
    source = folder / abi.CPU_SOURCE

    def compile_to(tmp: Path) -> None:
        cmd = [cxx, *flags, f"-I{CSRC_DIR}", f"-I{(folder / abi.HEADER).parent}", str(source), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise CpuBuildError(f"kv-canary: {cxx} could not build the cpu library from {source}:\n"
                                f"{proc.stderr.strip()[-4000:]}\ncommand: {' '.join(cmd)}")
    return entry(out, compile_to)
