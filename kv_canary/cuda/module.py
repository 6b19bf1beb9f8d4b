"""Generated kernels loaded into CuPy modules, once per process, layer and device.

On first use for a device every generated .cu of the layer is compiled (or taken from the cache)
and loaded, and each module's exported ABI identity is compared with the Python layer's before
any of its kernels can run. Loading reads the identity back from the device, so it must happen
outside CUDA-graph capture: launch once (warm up) before capturing.
"""
from __future__ import annotations

import threading
import warnings
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from .abi import check_identity
from .nvrtc import cached_binary, target_for
from .sources import kernel_abi, read_source

_NUMPY = {"ptr": np.uint64, "i64": np.int64, "i32": np.int32}


class DeviceModules:
    """Every kernel of one layer, loaded on one device."""

    def __init__(self, layer, device_index: int):
        import cupy
        self.layer = layer
        self.device_index = device_index
        abi = kernel_abi(layer)
        device = cupy.cuda.Device(device_index)
        cc = int(device.compute_capability)
        self.arch, self.cubin = target_for(cc)
        self.sm_count = int(device.attributes["MultiProcessorCount"])
        headers = layer_headers(layer)
        self.functions = {}
        self.binaries = {}
        self.resident_blocks: dict[str, int] = {}  # entry point -> blocks one SM keeps resident
        self.function_ptrs: dict[str, int] = {}    # entry point -> its CUfunction on this device (0: unknown)
        self._streams: dict = {}
        with device:
            for kernel in abi.KERNELS.values():
                path = cached_binary(read_source(layer, kernel.source), kernel.source, headers,
                                     arch=self.arch, cubin=self.cubin)
                module = cupy.RawModule(path=str(path))
                version = self._read_global(cupy, module, abi.ABI_VERSION_SYMBOL, np.int32)
                fingerprint = self._read_global(cupy, module, abi.LAYOUT_FINGERPRINT_SYMBOL, np.uint64)
                check_identity(layer, module_abi_version=version, module_fingerprint=fingerprint,
                               module_desc=f"the CUDA module {path.name} ({kernel.source})")
                for symbol, _ in kernel.variants:
                    # get_function loads the module on this device now (not at the first launch,
                    # which may happen during CUDA-graph capture).
                    fn = self.functions[symbol] = module.get_function(symbol)
                    _force_load(fn)
                    self.function_ptrs[symbol] = _function_ptr(fn)
                    if kernel.shape == "persistent":
                        self.resident_blocks[symbol] = resident_blocks_per_sm(cupy, fn, kernel.threads)
                self.binaries[kernel.name] = path

    @staticmethod
    def _read_global(cupy, module, symbol: str, dtype) -> int:
        ptr = module.get_global(symbol)
        return int(cupy.ndarray((1,), dtype=dtype, memptr=ptr).get()[0])

    def stream(self, torch_stream):
        """CuPy's view of a torch stream (cached: one object per raw stream)."""
        import cupy
        ptr = torch_stream.cuda_stream
        s = self._streams.get(ptr)
        if s is None:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", DeprecationWarning)  # CuPy 14 prefers Stream.from_external
                s = self._streams[ptr] = cupy.cuda.ExternalStream(ptr, self.device_index)
        return s

    def persistent_blocks(self, entry_point: str, blocks_per_sm: int) -> int:
        """Grid of a persistent kernel: kernels.yaml's blocks_per_sm is the upper bound, clamped to
        what the compiled kernel can keep resident (registers, shared memory), so the grid-stride
        loop runs in a single wave instead of leaving a partial second wave."""
        return persistent_grid(self.sm_count, blocks_per_sm, self.resident_blocks.get(entry_point, 0))

    def launch(self, entry_point: str, *, blocks: int, threads: int, kinds: tuple, args: tuple) -> None:
        """Launch through CuPy's RawKernel (every argument converted to a numpy scalar) on torch's
        current stream of this device; returns without waiting."""
        import cupy
        fn = self.functions[entry_point]
        args = tuple(_NUMPY[kind](value) for kind, value in zip(kinds, args))
        with cupy.cuda.Device(self.device_index), self.stream(torch.cuda.current_stream(self.device_index)):
            fn((blocks,), (threads,), args)

    def prepared(self, entry_point: str, *, blocks: int, threads: int, params) -> Callable[..., None]:
        """A function launching `entry_point` with packed `params` (kv_canary/cuda/params.py, kept
        alive by it) on torch's current stream of this device, without waiting: one cuLaunchKernel
        call, the device switched only when another one is current. Where CuPy lacks the driver
        binding, it falls back to `launch` (RawKernel) with the params' values. The function ignores
        its optional argument."""
        import cupy
        launch_kernel = getattr(cupy.cuda.driver, "launchKernel", None)
        function_ptr, index = self.function_ptrs.get(entry_point, 0), self.device_index
        if launch_kernel is None or not function_ptr:
            def by_value(_unused=None, params=params) -> None:
                self.launch(entry_point, blocks=blocks, threads=threads, kinds=params.kinds, args=params.values)
            return by_value
        current_stream, current_device, device = _raw_stream_of, cupy.cuda.runtime.getDevice, cupy.cuda.Device

        def launch(_unused=None, params=params) -> None:
            stream = current_stream(index)
            if current_device() == index:
                launch_kernel(function_ptr, blocks, 1, 1, threads, 1, 1, 0, stream, params.address, 0)
            else:
                with device(index):
                    launch_kernel(function_ptr, blocks, 1, 1, threads, 1, 1, 0, stream, params.address, 0)
        return launch


def _public_raw_stream(device_index: int) -> int:
    return torch.cuda.current_stream(device_index).cuda_stream


# device index -> the raw handle of torch's current stream there: the cheap binding torch's own
# compiled kernels use, or the public API where a torch build lacks it.
_raw_stream_of = getattr(torch._C, "_cuda_getCurrentRawStream", None) or _public_raw_stream


def layer_headers(layer) -> dict[str, str]:
    """The in-memory includes of a CUDA source built against `layer`: its generated layout header."""
    abi = kernel_abi(layer)
    return {Path(abi.HEADER).name: read_source(layer, abi.HEADER)}


def load_source_module(layer, source: str, name: str, device_index: int):
    """A CuPy RawModule of a .cu that is not one of the layer's kernels but includes its
    kv_canary_layout.cuh (a benchmark's reference kernel), compiled for the device through the same
    cache as the layer's kernels. Like the layer's modules, load it before any CUDA-graph capture."""
    import cupy
    device = cupy.cuda.Device(device_index)
    arch, cubin = target_for(int(device.compute_capability))
    path = cached_binary(source, name, layer_headers(layer), arch=arch, cubin=cubin)
    with device:
        return cupy.RawModule(path=str(path))


def persistent_grid(sm_count: int, blocks_per_sm: int, resident: int) -> int:
    """sm_count x min(blocks_per_sm, resident); resident <= 0 (unknown) keeps blocks_per_sm."""
    per_sm = min(blocks_per_sm, resident) if resident > 0 else blocks_per_sm
    return sm_count * max(1, per_sm)


def _function_ptr(fn) -> int:
    """The CUfunction handle of a loaded RawKernel on the current device (0 when CuPy hides it)."""
    try:
        return int(fn.kernel.ptr)
    except Exception:  # another CuPy: launches then go through RawKernel (DeviceModules.launch)
        return 0


def _force_load(fn) -> None:
    """Query an attribute so that the driver loads the function now even under CUDA's lazy module
    loading (CUDA_MODULE_LOADING=LAZY, the default), never at a launch inside graph capture."""
    try:
        fn.num_regs
    except Exception:  # nothing to gain from failing here; the launch reports a real problem
        pass


def resident_blocks_per_sm(cupy, fn, threads: int) -> int:
    """CUDA's occupancy calculator for a loaded kernel at `threads` per block (0 when unknown)."""
    try:
        return int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, 0))
    except Exception as exc:  # an old driver or CuPy without the binding: keep the schema's value
        warnings.warn(f"kv-canary: occupancy of {fn.name} unknown ({exc}); using blocks_per_sm from kernels.yaml",
                      RuntimeWarning, stacklevel=2)
        return 0


class LayerModules:
    """DeviceModules of one layer, created on first use per device."""

    def __init__(self, layer):
        self.layer = layer
        self._devices: dict = {}
        self._lock = threading.Lock()

    def for_device(self, device_index: int) -> DeviceModules:
        mods = self._devices.get(device_index)
        if mods is not None:
            return mods
        with self._lock:
            mods = self._devices.get(device_index)
            if mods is None:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        f"kv-canary: the CUDA kernels of {self.layer.__name__} are compiled and loaded on first use "
                        f"on cuda:{device_index}, which cannot happen during CUDA-graph capture; launch once (or call "
                        f"the backend's warm_up(device)) before capturing")
                mods = self._devices[device_index] = DeviceModules(self.layer, device_index)
        return mods
