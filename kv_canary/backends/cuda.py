"""The `cuda` backend: the generated kernels on a GPU through CuPy.

On first use per device every generated .cu of the tree is compiled with NVRTC (or taken from the
compile cache: kv_canary/trees/nvrtc.py) and loaded as a CuPy RawModule, and each module's exported
ABI identity is compared with the Python package's before any of its kernels can run. Loading reads
the identity back from the device, so it must happen outside CUDA-graph capture: launch once (or
call `warm_up(device)`) before capturing.

Tensors are passed zero-copy (their data pointers, bound once per prepared launch); a launch is
CuPy's own kernel call (`RawModule.get_function(entry)(grid, block, args)`) on torch's current CUDA
stream, so it orders with torch work and can be captured in CUDA graphs. No launch synchronises
the host.

Launch shapes come from kernels.yaml. A `persistent` kernel (verify) gets SM count x
min(blocks_per_sm, blocks the compiled kernel keeps resident per SM, from CUDA's occupancy
calculator) blocks: the schema's blocks_per_sm is an upper bound, and the grid-stride loop runs in
one wave. It is further capped by the blocks the plan's capacity can fill. `fixed_grid` pins the
grid exactly (e.g. SGLang's 64 x 512). `block_per_request` (write) launches one block per request
of the plan's capacity; blocks past the device-side active count exit at once.
"""
from __future__ import annotations

import threading
import warnings
from pathlib import Path

import numpy as np
import torch

from ..trees.identity import check_identity
from ..trees.nvrtc import cached_binary, target_for
from ..trees.sources import kernel_abi, read_source
from . import BackendUnavailable
from .kernels import KernelBackend, blocks_for

_NUMPY = {"ptr": np.uint64, "i64": np.int64, "i32": np.int32}


class DeviceModules:
    """Every kernel of one tree, loaded on one device."""

    def __init__(self, tree, device_index: int):
        import cupy
        self.tree = tree
        self.device_index = device_index
        abi = kernel_abi(tree)
        device = cupy.cuda.Device(device_index)
        cc = int(device.compute_capability)
        self.arch, self.cubin = target_for(cc)
        self.sm_count = int(device.attributes["MultiProcessorCount"])
        headers = tree_headers(tree)
        self.functions = {}
        self.binaries = {}
        self.resident_blocks: dict[str, int] = {}  # entry point -> blocks one SM keeps resident
        self._streams: dict = {}
        with device:
            for kernel in abi.KERNELS.values():
                path = cached_binary(read_source(tree, kernel.source), kernel.source, headers,
                                     arch=self.arch, cubin=self.cubin)
                module = cupy.RawModule(path=str(path))
                version = self._read_global(cupy, module, abi.ABI_VERSION_SYMBOL, np.int32)
                fingerprint = self._read_global(cupy, module, abi.LAYOUT_FINGERPRINT_SYMBOL, np.uint64)
                check_identity(tree, module_abi_version=version, module_fingerprint=fingerprint,
                               module_desc=f"the CUDA module {path.name} ({kernel.source})")
                for symbol, _ in kernel.variants:
                    # get_function loads the module on this device now, and querying an attribute loads
                    # the function even under CUDA's lazy loading (CUDA_MODULE_LOADING=LAZY, the default):
                    # never at the first launch, which may happen during CUDA-graph capture.
                    fn = self.functions[symbol] = module.get_function(symbol)
                    try:
                        fn.num_regs
                    except Exception:  # nothing to gain from failing here; the launch reports a real problem
                        pass
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
        """Grid of a persistent kernel (the module docstring): one wave of the grid-stride loop."""
        return persistent_grid(self.sm_count, blocks_per_sm, self.resident_blocks.get(entry_point, 0))

    def launcher(self, entry_point: str, *, blocks: int, threads: int, kinds: tuple, values: tuple):
        """A launch through CuPy's own kernel call (RawKernel.__call__; every argument a numpy scalar
        of its C type, converted once here) on torch's current stream of this device; it returns
        without waiting."""
        import cupy
        fn, index, device = self.functions[entry_point], self.device_index, cupy.cuda.Device
        grid, block = (blocks,), (threads,)
        args = tuple(_NUMPY[kind](value) for kind, value in zip(kinds, values))
        current_stream, stream_of = torch.cuda.current_stream, self.stream

        def launch() -> None:  # a Device per launch: its context manager keeps per-object state
            with device(index), stream_of(current_stream(index)):
                fn(grid, block, args)
        return launch

def tree_headers(tree) -> dict[str, str]:
    """The in-memory includes of a CUDA source built against `tree`: its generated layout header."""
    abi = kernel_abi(tree)
    return {Path(abi.HEADER).name: read_source(tree, abi.HEADER)}


def load_source_module(tree, source: str, name: str, device_index: int):
    """A CuPy RawModule of a .cu that is not one of the tree's kernels but includes its
    kv_canary_layout.cuh (a benchmark's reference kernel), compiled for the device through the same
    cache as the tree's kernels. Like the tree's modules, load it before any CUDA-graph capture."""
    import cupy
    device = cupy.cuda.Device(device_index)
    arch, cubin = target_for(int(device.compute_capability))
    path = cached_binary(source, name, tree_headers(tree), arch=arch, cubin=cubin)
    with device:
        return cupy.RawModule(path=str(path))


def persistent_grid(sm_count: int, blocks_per_sm: int, resident: int) -> int:
    """sm_count x min(blocks_per_sm, resident); resident <= 0 (unknown) keeps blocks_per_sm."""
    per_sm = min(blocks_per_sm, resident) if resident > 0 else blocks_per_sm
    return sm_count * max(1, per_sm)


def resident_blocks_per_sm(cupy, fn, threads: int) -> int:
    """CUDA's occupancy calculator for a loaded kernel at `threads` per block (0 when unknown)."""
    try:
        return int(cupy.cuda.driver.occupancyMaxActiveBlocksPerMultiprocessor(fn.kernel.ptr, threads, 0))
    except Exception as exc:  # an old driver or CuPy without the binding: keep the schema's value
        warnings.warn(f"kv-canary: occupancy of {fn.name} unknown ({exc}); using blocks_per_sm from kernels.yaml",
                      RuntimeWarning, stacklevel=2)
        return 0


class CudaBackend(KernelBackend):
    name = "cuda"

    def __init__(self, tree):
        super().__init__(tree)
        self._device_modules: dict[int, DeviceModules] = {}  # device index -> its modules, made on first use
        self._load_lock = threading.Lock()

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"kv-canary: backend 'cuda' needs CUDA tensors, got tensors on {device}")

    def warm_up(self, device=None) -> DeviceModules:
        """Compile and load every kernel for `device` now (before CUDA-graph capture, say)."""
        device = torch.device(device if device is not None else "cuda")
        index = device.index if device.index is not None else torch.cuda.current_device()
        mods = self._device_modules.get(index)
        if mods is not None:
            return mods
        with self._load_lock:
            mods = self._device_modules.get(index)
            if mods is None:
                if torch.cuda.is_current_stream_capturing():
                    raise RuntimeError(
                        f"kv-canary: the CUDA kernels of {self.tree.__name__} are compiled and loaded on first use "
                        f"on cuda:{index}, which cannot happen during CUDA-graph capture; launch once (or call "
                        f"the backend's warm_up(device)) before capturing")
                mods = self._device_modules[index] = DeviceModules(self.tree, index)
        return mods

    def persistent_blocks(self, kernel, device: torch.device, entry_point: str | None = None) -> int:
        """SM count x blocks_per_sm (kernels.yaml), clamped to the compiled kernel's occupancy."""
        return self.warm_up(device).persistent_blocks(entry_point or kernel.variants[0][0], kernel.blocks_per_sm)

    def grid(self, kernel, entry_point: str, *, work: int, device: torch.device) -> tuple[int, int]:
        persistent = self.persistent_blocks(kernel, device, entry_point) if kernel.shape == "persistent" else 0
        return blocks_for(kernel, work, threads=kernel.threads, persistent_blocks=persistent), kernel.threads

    def launcher(self, kernel, entry_point: str, *, blocks: int, threads: int, values: tuple, device):
        return self.warm_up(device).launcher(entry_point, blocks=blocks, threads=threads, kinds=kernel.kinds,
                                             values=values)


def create(tree) -> CudaBackend:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(f"CuPy is not installed ({exc})") from exc
    if not cupy.is_available():
        raise BackendUnavailable("CuPy sees no CUDA device")
    if not torch.cuda.is_available():
        raise BackendUnavailable("torch sees no CUDA device")
    return CudaBackend(tree)
