"""Compile a generated .cu with NVRTC through CuPy's low-level bindings (no GPU needed).

The generated header and the hand-written device headers (kv_canary/csrc/) are handed to NVRTC as
in-memory includes, so a compiled binary depends on exactly the texts hashed into its cache key. A compile error raises CudaCompileError quoting the
NVRTC log, whose file:line references point at the Jinja templates (#line directives).
"""
from __future__ import annotations

import functools
from pathlib import Path

from .cache import cache_dir, content_key, entry
from .csrc import csrc_headers

DEFAULT_OPTIONS = ("-std=c++17", "-lineinfo")


class CudaCompileError(RuntimeError):
    """NVRTC rejected a generated source."""


def _nvrtc():
    try:
        from cupy_backends.cuda.libs import nvrtc
    except ImportError as exc:  # CuPy missing or without its NVRTC library
        raise CudaCompileError(f"kv-canary: NVRTC is not available through CuPy: {exc}") from exc
    return nvrtc


@functools.lru_cache(maxsize=1)
def nvrtc_version() -> tuple[int, int]:
    return tuple(_nvrtc().getVersion())


@functools.lru_cache(maxsize=1)
def supported_archs() -> tuple[int, ...]:
    return tuple(int(a) for a in _nvrtc().getSupportedArchs())


def compile_source(source: str, name: str, headers: dict[str, str], *, arch: int, cubin: bool = True,
                   options: tuple[str, ...] = DEFAULT_OPTIONS) -> bytes:
    """A CUBIN for sm_<arch> (or PTX for compute_<arch> when cubin=False). `headers`: the generated
    includes (include name -> text); the kv_canary/csrc/ headers are added."""
    nvrtc = _nvrtc()
    headers = {**csrc_headers(), **headers}
    target = f"--gpu-architecture={'sm' if cubin else 'compute'}_{arch}"
    prog = nvrtc.createProgram(source, name, [text.encode("utf-8") for text in headers.values()],
                               [include.encode("utf-8") for include in headers])
    try:
        try:
            nvrtc.compileProgram(prog, [target, *options])
        except nvrtc.NVRTCError as exc:
            log = nvrtc.getProgramLog(prog)
            raise CudaCompileError(f"kv-canary: NVRTC {'.'.join(map(str, nvrtc_version()))} could not compile {name} "
                                   f"for {target.split('=')[1]} ({exc}); compiler log:\n{log.strip()}") from None
        return nvrtc.getCUBIN(prog) if cubin else nvrtc.getPTX(prog)
    finally:
        nvrtc.destroyProgram(prog)


def cached_binary(source: str, name: str, headers: dict[str, str], *, arch: int, cubin: bool = True,
                  options: tuple[str, ...] = DEFAULT_OPTIONS) -> Path:
    """compile_source through the project cache; returns the path of the .cubin / .ptx. The key covers
    every include, the kv_canary/csrc/ headers too."""
    key = content_key("kv-canary-nvrtc-1", nvrtc_version(), arch, cubin, " ".join(options), name, source,
                      *(part for include, text in sorted({**csrc_headers(), **headers}.items()) for part in (include, text)))
    path = cache_dir("cuda") / f"{Path(name).stem}_{'sm' if cubin else 'compute'}{arch}_{key[:32]}.{'cubin' if cubin else 'ptx'}"
    return entry(path, lambda tmp: tmp.write_bytes(compile_source(source, name, headers, arch=arch, cubin=cubin,
                                                                  options=options)))


def target_for(compute_capability: int) -> tuple[int, bool]:
    """(arch, cubin?) for a device: its own SASS when NVRTC knows it, else PTX for the newest arch
    NVRTC knows below it (the driver JIT-compiles that)."""
    archs = supported_archs()
    if compute_capability in archs:
        return compute_capability, True
    lower = [a for a in archs if a <= compute_capability]
    if not lower:
        raise CudaCompileError(f"kv-canary: NVRTC {nvrtc_version()} supports {archs}, none usable for "
                               f"compute capability {compute_capability}")
    return max(lower), False
