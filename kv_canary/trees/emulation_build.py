"""Build the emulation library of a generated tree with g++, cached by content.

The library is one translation unit: the generated launchers file includes the shim and every
generated .cu, which include the hand-written device headers (kv_canary/csrc/). Its cache key covers
the compiler, the flags and the text of every input, those headers too, so an
edited template or schema always rebuilds, and an unchanged tree is built once per machine.

With KV_CANARY_EMULATION_SANITIZE=1 (what `make sanitize` sets) the library is built with
AddressSanitizer and UndefinedBehaviorSanitizer as its own cache entry (kv_canary/trees/sanitize.py).
"""
from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path

from .cache import cache_dir, content_key, entry
from .csrc import CSRC_DIR, csrc_headers
from .sanitize import ENV_SANITIZE, SANITIZE_FLAGS, asan_runtime_loaded, build_flags, sanitize_enabled
from .sources import kernel_abi, read_source, tree_dir

SHIM_DIR = Path(__file__).resolve().parent.parent / "emulation"  # the hand-written shim (package data)
SHIM_HEADER = SHIM_DIR / "cuda_host_shim.h"
INCLUDE_DIRS = (SHIM_DIR, CSRC_DIR)  # g++ -I: the shim, then the device headers
CXX_FLAGS = ("-std=c++17", "-O2", "-shared", "-fPIC", "-fvisibility=hidden", "-Wall", "-Wextra",
             "-Wno-unknown-pragmas", "-Werror")
__all__ = ["ENV_SANITIZE", "SANITIZE_FLAGS", "asan_runtime_loaded", "sanitize_enabled"]  # re-exported (sanitize.py)


class EmulationBuildError(RuntimeError):
    """g++ rejected the generated sources; the message quotes its diagnostics."""


@functools.lru_cache(maxsize=None)
def compiler() -> tuple[str, str]:
    """(path, version) of g++, or raise when there is none."""
    path = shutil.which("g++")
    if path is None:
        raise EmulationBuildError("kv-canary: the emulated backend needs g++ on PATH, found none")
    version = subprocess.run([path, "--version"], capture_output=True, text=True, check=True).stdout.splitlines()[0]
    return path, version


def library_inputs(tree) -> list[tuple[str, str]]:
    """(name, text) of every file the library is built from, in a fixed order."""
    abi = kernel_abi(tree)
    names = [abi.EMULATION_SOURCE, abi.HEADER] + [k.source for k in abi.KERNELS.values()]
    return ([("cuda_host_shim.h", SHIM_HEADER.read_text(encoding="utf-8"))] + list(csrc_headers().items())
            + [(name, read_source(tree, name)) for name in names])


def build_library(tree) -> Path:
    """Path of the tree's emulation library, compiling it on a cache miss."""
    gxx, version = compiler()
    flags, sanitized = build_flags(CXX_FLAGS, library="emulation", error=EmulationBuildError)
    inputs = library_inputs(tree)
    key = content_key("kv-canary-emulation-1", version, " ".join(flags),
                      *(part for name, text in inputs for part in (name, text)))
    out = cache_dir("emulation") / f"kv_canary_emu_{'asan_ubsan_' if sanitized else ''}{key[:32]}.so"
    source = tree_dir(tree) / kernel_abi(tree).EMULATION_SOURCE

    def compile_to(tmp: Path) -> None:
        cmd = [gxx, *flags, *(f"-I{d}" for d in INCLUDE_DIRS), str(source), "-o", str(tmp)]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise EmulationBuildError(f"kv-canary: g++ could not build the emulation library from {source}:\n"
                                      f"{proc.stderr.strip()}\ncommand: {' '.join(cmd)}")
    return entry(out, compile_to)
