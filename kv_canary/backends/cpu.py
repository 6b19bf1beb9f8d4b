"""The `cpu` backend: the schema's kernels compiled for this host (the generated cpu/kv_canary_cpu.cpp
over kv_canary/csrc/kvc_cpu.h's loops and the same device functions as the CUDA kernels; built by
kv_canary/trees/cpu_build.py) and loaded with ctypes. The default backend for CPU tensors.

Arguments are bound as for the emulated backend (the generated kernel ABI, packed once per prepared
launch into 8-byte slots), so a prepared launch costs one ctypes call of three arguments: the thread
count, the grain and the slots. A launch uses up to `threads` threads (KV_CANARY_CPU_THREADS, else
every core this process may run on; `set_threads(n)` changes it for the launches that follow), each
taking at least `grain` entries (DEFAULT_GRAIN), so a small launch runs on the calling thread alone
(kvc_cpu.h).

As a host backend it reads index values for free: like the torch reference it raises for request
rows outside req_to_token / pool_out, for SWA indices outside the LUT and for a plan-entries scratch
the offsets stage did not fill (the operations' HostChecks), before any kernel writes.

A kernel whose operation has no host loop in kvc_cpu.h (codegen/operations.py KernelTemplateSpec.cpu:
a new operation until it gets one) is not in the library: an operation launching it runs the torch
reference instead, so a new kernel works on CPU tensors from the start.
"""
from __future__ import annotations

import ctypes
import os
import sys
from pathlib import Path

import torch

from ..trees.identity import check_identity
from ..trees.memo import PerTree
from ..trees.sources import kernel_abi
from . import BackendUnavailable
from .kernels import KernelBackend, packer

if sys.byteorder != "little":  # the slot layout: a 32-bit value sits in the slot's first bytes
    raise ImportError("kv-canary: packed kernel arguments assume a little-endian host")

ENV_THREADS = "KV_CANARY_CPU_THREADS"
# Entries (or tokens) a thread takes at least: a thread is started per launch (~20 us), and 4096
# entries take ~50-100 us on one core.
DEFAULT_GRAIN = 4096
_CPU = torch.device("cpu")


class CpuLaunchError(RuntimeError):
    """A cpu kernel failed (it could not allocate its scratch)."""


def default_threads() -> int:
    """KV_CANARY_CPU_THREADS, else the cores this process may run on."""
    text = os.environ.get(ENV_THREADS, "").strip()
    if text:
        try:
            threads = int(text)
        except ValueError:
            threads = 0
        if threads < 1:
            raise ValueError(f"kv-canary: {ENV_THREADS} must be a positive integer, got {text!r}")
        return threads
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except (AttributeError, OSError):
        return max(1, os.cpu_count() or 1)


class CpuLibrary:
    """One loaded library, bound to the Python package whose kernels it must match."""

    def __init__(self, tree, path: Path | str):
        self.path = Path(path)
        self.abi = kernel_abi(tree)
        self.lib = ctypes.CDLL(str(self.path))
        try:
            version_fn = getattr(self.lib, self.abi.CPU_ABI_VERSION_FUNCTION)
            fingerprint_fn = getattr(self.lib, self.abi.CPU_LAYOUT_FINGERPRINT_FUNCTION)
        except AttributeError as exc:
            raise CpuLaunchError(f"kv-canary: {self.path} is not a kv-canary cpu library (missing {exc}); rebuild it "
                                 f"from generated/ (`make generate`)") from None
        version_fn.restype, fingerprint_fn.restype = ctypes.c_int, ctypes.c_ulonglong
        check_identity(tree, module_abi_version=version_fn(), module_fingerprint=fingerprint_fn(),
                       module_desc=f"the cpu library {self.path}")
        self.lib.kvc_cpu_last_error.restype = ctypes.c_char_p
        self._entry_points: dict = {}

    def entry_point(self, entry_point: str):
        """The C function taking (threads, grain, packed slots) for `entry_point`."""
        fn = self._entry_points.get(entry_point)
        if fn is None:
            fn = getattr(self.lib, self.abi.CPU_PARAMS_LAUNCHER_PREFIX + entry_point)
            fn.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_char_p]
            fn.restype = ctypes.c_int
            self._entry_points[entry_point] = fn
        return fn

    def has(self, entry_point: str) -> bool:
        """Whether the library holds `entry_point` (its operation has a kvc_cpu.h loop)."""
        return hasattr(self.lib, self.abi.CPU_PARAMS_LAUNCHER_PREFIX + entry_point)

    def failure(self, entry_point: str) -> CpuLaunchError:
        reason = self.lib.kvc_cpu_last_error().decode("utf-8", "replace")
        return CpuLaunchError(f"kv-canary: cpu launch of {entry_point} failed: {reason}")


def _load_library(tree) -> CpuLibrary:
    from ..trees.cpu_build import build_library
    return CpuLibrary(tree, build_library(tree))


_libraries: PerTree[CpuLibrary] = PerTree(_load_library)


def library_for(tree) -> CpuLibrary:
    """The tree's loaded cpu library: built (or found in the cache) once per process."""
    return _libraries.get(tree)


class _NotInLibrary(Exception):
    """An operation launches a kernel the cpu library does not hold."""


class CpuBackend(KernelBackend):
    name = "cpu"
    checks_index_values = "all"  # it reads index values for free (kv_canary/launch/operations.py HostChecks)

    def __init__(self, tree, *, threads: int | None = None):
        super().__init__(tree)
        self.threads, self.grain = 1, DEFAULT_GRAIN
        self.set_threads(default_threads() if threads is None else threads)
        self.library = library_for(tree)   # eager: a build error surfaces here, not mid-batch
        self._packers = {name: packer(kernel.kinds) for name, kernel in self.abi.KERNELS.items()}
        # The kernels the library holds (by operation); an operation launching another runs the torch reference.
        self.native = frozenset(operation for operation, kernel in self.kernels.items()
                                if all(self.library.has(symbol) for symbol, _ in kernel.variants))
        self._reference = None

    def bound(self, template: str, args, **kw) -> tuple:
        if template not in self.native:
            raise _NotInLibrary(template)
        return super().bound(template, args, **kw)

    def prepare(self, operation, args: dict, *, read: list | None = None):
        try:
            return super().prepare(operation, args, read=read)
        except _NotInLibrary:  # no kvc_cpu.h loop for one of its kernels yet
            if self._reference is None:
                from .torch import create as torch_backend
                self._reference = torch_backend(self.tree)
            return self._reference.prepare(operation, args, read=read)

    def set_threads(self, threads: int, *, grain: int | None = None) -> None:
        """The most threads each later launch uses (prepared launches included), and the fewest
        entries each thread takes (`grain`, default DEFAULT_GRAIN; 1 splits even tiny launches)."""
        for name, value in (("threads", threads), ("grain", DEFAULT_GRAIN if grain is None else grain)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"kv-canary: the cpu backend's {name} must be a positive int, got {value!r}")
        self.threads, self.grain = threads, DEFAULT_GRAIN if grain is None else grain

    def check_device(self, device: torch.device) -> None:
        if device != _CPU:  # not device.type, which costs a string per launch
            raise ValueError(f"kv-canary: backend 'cpu' runs the kernels on the host and needs CPU tensors, "
                             f"got tensors on {device}")

    def grid(self, kernel, entry_point: str, *, work: int, device: torch.device) -> tuple[int, int]:
        return 1, 1  # one call per launch; its threads are chosen at run time (kvc_cpu.h)

    def launcher(self, kernel, entry_point: str, *, blocks: int, threads: int, values: tuple, device):
        fn = self.library.entry_point(entry_point)
        packed = self._packers[kernel.name].pack(*values)
        library = self.library

        def launch() -> None:
            if fn(self.threads, self.grain, packed) != 0:
                raise library.failure(entry_point)
        return launch


def create(tree) -> CpuBackend:
    from ..trees.cpu_build import CpuBuildError
    try:
        return CpuBackend(tree)
    except (CpuBuildError, OSError) as exc:
        raise BackendUnavailable(str(exc)) from exc
