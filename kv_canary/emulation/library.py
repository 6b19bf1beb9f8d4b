"""Load an emulation library with ctypes, check its ABI identity, launch its kernels.

Strict warp mode is switched on at load: undefined warp behaviour (a shuffle naming an inactive
lane, a barrier some threads skip) fails the launch instead of passing silently.

Two ways in: `launch` passes every parameter as a C argument (ctypes converts each one per call);
`prepared` returns a launch of packed arguments (kv_canary/cuda/params.py, cuLaunchKernel's
convention), which the emulated backend binds once and then launches with three C arguments.
"""
from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Callable

from ..cuda.abi import check_identity
from ..cuda.sources import kernel_abi

# The C kind of a kernel parameter (generated kernel_abi KernelAbi.kinds) -> its ctypes type.
CTYPES = {"ptr": ctypes.c_void_p, "i64": ctypes.c_longlong, "i32": ctypes.c_int}


class EmulationLaunchError(RuntimeError):
    """A kernel failed under emulation (strict warp check, trap, bad launch shape)."""


class EmulationLibrary:
    """One loaded library, bound to the Python layer whose kernels it must match."""

    def __init__(self, layer, path: Path | str):
        self.layer = layer
        self.path = Path(path)
        self.abi = kernel_abi(layer)
        self.lib = ctypes.CDLL(str(self.path))
        try:
            version_fn = getattr(self.lib, self.abi.EMULATION_ABI_VERSION_FUNCTION)
            fingerprint_fn = getattr(self.lib, self.abi.EMULATION_LAYOUT_FINGERPRINT_FUNCTION)
        except AttributeError as exc:
            raise EmulationLaunchError(f"kv-canary: {self.path} is not a kv-canary emulation library "
                                       f"(missing {exc}); rebuild it from generated/ (`make generate`)") from None
        version_fn.restype, fingerprint_fn.restype = ctypes.c_int, ctypes.c_ulonglong
        check_identity(layer, module_abi_version=version_fn(), module_fingerprint=fingerprint_fn(),
                       module_desc=f"the emulation library {self.path}")
        self.lib.kvc_emu_last_error.restype = ctypes.c_char_p
        self.lib.kvc_emu_set_strict.argtypes = [ctypes.c_int]
        self.lib.kvc_emu_set_strict(1)
        self._launchers: dict = {}
        self._params_launchers: dict = {}

    def launcher(self, kernel, entry_point: str):
        fn = self._launchers.get(entry_point)
        if fn is None:
            fn = getattr(self.lib, self.abi.EMULATION_LAUNCHER_PREFIX + entry_point)
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [CTYPES[kind] for kind in kernel.kinds]
            fn.restype = ctypes.c_int
            self._launchers[entry_point] = fn
        return fn

    def launch(self, kernel, entry_point: str, *, blocks: int, threads: int, args: tuple) -> None:
        rc = self.launcher(kernel, entry_point)(blocks, threads, *args)
        if rc != 0:
            raise self.failure(entry_point, blocks, threads)

    def params_launcher(self, entry_point: str):
        fn = self._params_launchers.get(entry_point)
        if fn is None:
            prefix = getattr(self.abi, "EMULATION_PARAMS_LAUNCHER_PREFIX", None)
            if prefix is None:
                raise EmulationLaunchError(f"kv-canary: {self.layer.__name__}.kernel_abi predates packed-argument "
                                           f"launchers; regenerate it (`make generate`)")
            fn = getattr(self.lib, prefix + entry_point)
            fn.argtypes = [ctypes.c_uint, ctypes.c_uint, ctypes.c_void_p]
            fn.restype = ctypes.c_int
            self._params_launchers[entry_point] = fn
        return fn

    def prepared(self, entry_point: str, *, blocks: int, threads: int, params) -> Callable[..., None]:
        """A launch of `entry_point` reading `params` (a KernelParams, kept alive by the launch); it
        ignores its optional argument."""
        fn = self.params_launcher(entry_point)

        def launch(_unused=None, params=params) -> None:
            if fn(blocks, threads, params.address) != 0:
                raise self.failure(entry_point, blocks, threads)
        return launch

    def failure(self, entry_point: str, blocks: int, threads: int) -> EmulationLaunchError:
        reason = self.lib.kvc_emu_last_error().decode("utf-8", "replace")
        return EmulationLaunchError(f"kv-canary: emulated launch of {entry_point} (grid {blocks} x {threads}) "
                                    f"failed: {reason}")
