"""The `emulated` backend: the generated CUDA kernels compiled for the host (g++ against
kv_canary/emulation/cuda_host_shim.h; built by kv_canary/trees/emulation_build.py) and loaded with
ctypes. Same kernels, same argument binding and same launch shapes as the `cuda` backend, on CPU
tensors. Blocks stay small (EMULATED_THREADS threads, EMULATED_PERSISTENT_BLOCKS blocks for
persistent grids) so that tests are fast while still running several warps and several blocks.

A launch passes its arguments packed (one 8-byte slot per parameter holding its value; a 32-bit
`int` in the slot's low bytes) to the generated kvc_emu_params_launch_<entry point>: packed once,
into a bytes object, when the launch is prepared, so a prepared launch costs one ctypes call of
three arguments. Strict warp mode is on: undefined warp behaviour (a shuffle naming an inactive
lane, a barrier some threads skip) fails the launch.

As a host backend it reads index values for free: like the torch reference it raises for request
rows outside req_to_token / pool_out, for SWA indices outside the LUT and for a plan-entries
scratch the offsets stage did not fill (the operations' HostChecks), where a GPU kernel can only mark them.
"""
from __future__ import annotations

import ctypes
import sys
from pathlib import Path

import torch

from ..trees.identity import check_identity
from ..trees.memo import PerTree
from ..trees.sources import kernel_abi
from . import BackendUnavailable
from .kernels import KernelBackend, blocks_for, packer

if sys.byteorder != "little":  # the slot layout above: a 32-bit value sits in the slot's first bytes
    raise ImportError("kv-canary: packed kernel arguments assume a little-endian host")

EMULATED_THREADS = 64
EMULATED_PERSISTENT_BLOCKS = 2
_CPU = torch.device("cpu")


class EmulationLaunchError(RuntimeError):
    """A kernel failed under emulation (strict warp check, trap, bad launch shape)."""


class EmulationLibrary:
    """One loaded library, bound to the Python package whose kernels it must match."""

    def __init__(self, tree, path: Path | str):
        self.tree = tree
        self.path = Path(path)
        self.abi = kernel_abi(tree)
        self.lib = ctypes.CDLL(str(self.path))
        try:
            version_fn = getattr(self.lib, self.abi.EMULATION_ABI_VERSION_FUNCTION)
            fingerprint_fn = getattr(self.lib, self.abi.EMULATION_LAYOUT_FINGERPRINT_FUNCTION)
        except AttributeError as exc:
            raise EmulationLaunchError(f"kv-canary: {self.path} is not a kv-canary emulation library "
                                       f"(missing {exc}); rebuild it from generated/ (`make generate`)") from None
        version_fn.restype, fingerprint_fn.restype = ctypes.c_int, ctypes.c_ulonglong
        check_identity(tree, module_abi_version=version_fn(), module_fingerprint=fingerprint_fn(),
                       module_desc=f"the emulation library {self.path}")
        self.lib.kvc_emu_last_error.restype = ctypes.c_char_p
        self.lib.kvc_emu_set_strict.argtypes = [ctypes.c_int]
        self.lib.kvc_emu_set_strict(1)
        self._entry_points: dict = {}

    def entry_point(self, entry_point: str):
        """The C function taking (grid, block, packed slots) for `entry_point`."""
        fn = self._entry_points.get(entry_point)
        if fn is None:
            fn = getattr(self.lib, self.abi.EMULATION_PARAMS_LAUNCHER_PREFIX + entry_point)
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_char_p]
            fn.restype = ctypes.c_int
            self._entry_points[entry_point] = fn
        return fn

    def launcher(self, entry_point: str, *, blocks: int, threads: int, packed: bytes):
        fn = self.entry_point(entry_point)

        def launch() -> None:
            if fn(blocks, threads, packed) != 0:
                raise self.failure(entry_point, blocks, threads)
        return launch

    def failure(self, entry_point: str, blocks: int, threads: int) -> EmulationLaunchError:
        reason = self.lib.kvc_emu_last_error().decode("utf-8", "replace")
        return EmulationLaunchError(f"kv-canary: emulated launch of {entry_point} (grid {blocks} x {threads}) "
                                    f"failed: {reason}")


def _load_library(tree) -> EmulationLibrary:
    from ..trees.emulation_build import build_library
    return EmulationLibrary(tree, build_library(tree))


_libraries: PerTree[EmulationLibrary] = PerTree(_load_library)


def library_for(tree) -> EmulationLibrary:
    """The tree's loaded emulation library: built (or found in the cache) once per process."""
    return _libraries.get(tree)


class EmulatedBackend(KernelBackend):
    name = "emulated"
    checks_index_values = "all"  # it reads index values for free (kv_canary/launch/operations.py HostChecks)

    def __init__(self, tree, *, threads: int = EMULATED_THREADS, persistent_blocks: int = EMULATED_PERSISTENT_BLOCKS):
        super().__init__(tree)
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"kv-canary: emulated threads per block must be a multiple of 32 in [32, 1024], got {threads}")
        self.threads = threads
        self.persistent_blocks = persistent_blocks
        self.library = library_for(tree)   # eager: a build error surfaces here, not mid-batch
        self._packers = {name: packer(kernel.kinds) for name, kernel in self.abi.KERNELS.items()}

    def check_device(self, device: torch.device) -> None:
        if device != _CPU:  # not device.type, which costs a string per launch
            raise ValueError(f"kv-canary: backend 'emulated' runs the kernels on the host and needs CPU tensors, "
                             f"got tensors on {device}")

    def grid(self, kernel, entry_point: str, *, work: int, device: torch.device) -> tuple[int, int]:
        # Never more threads than kernels.yaml declares: kernels size their shared memory by it.
        threads = min(self.threads, kernel.threads)
        return blocks_for(kernel, work, threads=threads, persistent_blocks=self.persistent_blocks), threads

    def launcher(self, kernel, entry_point: str, *, blocks: int, threads: int, values: tuple, device):
        return self.library.launcher(entry_point, blocks=blocks, threads=threads,
                                     packed=self._packers[kernel.name].pack(*values))


def create(tree) -> EmulatedBackend:
    from ..trees.emulation_build import EmulationBuildError
    try:
        return EmulatedBackend(tree)
    except EmulationBuildError as exc:
        raise BackendUnavailable(str(exc)) from exc
