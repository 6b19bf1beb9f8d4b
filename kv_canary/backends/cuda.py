"""The `cuda` backend: the generated kernels on a GPU through CuPy.

Tensors are passed zero-copy (their data pointers); launches go to torch's current CUDA stream,
so they order with torch work and can be captured in CUDA graphs. No launch path synchronises
the host. Kernels are compiled and loaded on first use per device (kv_canary/cuda/module.py).

A launch passes its packed arguments (kv_canary/cuda/params.py, bound once per set of inputs) to
cuLaunchKernel (CuPy's cupy.cuda.driver.launchKernel) on torch's current stream: no per-argument
conversion, no stream or device context manager per launch (kv_canary/cuda/module.py).

Launch shapes come from kernels.yaml. A `persistent` kernel (verify) gets SM count x
min(blocks_per_sm, blocks the compiled kernel keeps resident per SM, from CUDA's occupancy
calculator) blocks: the schema's blocks_per_sm is an upper bound, and the grid-stride loop runs in
one wave. It is further capped by the blocks the plan's capacity can fill. `fixed_grid` pins the
grid exactly (e.g. SGLang's 64 x 512). `block_per_request` (write) launches one block per request
of the plan's capacity; blocks past the device-side active count exit at once.
"""
from __future__ import annotations

import torch

from ..cuda.kernel_backend import KernelBackend, blocks_for
from ..cuda.module import LayerModules
from . import BackendUnavailable


class CudaBackend(KernelBackend):
    name = "cuda"

    def __init__(self, layer):
        super().__init__(layer)
        self.modules = LayerModules(layer)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cuda":
            raise ValueError(f"kv-canary: backend 'cuda' needs CUDA tensors, got tensors on {device}")

    def warm_up(self, device=None):
        """Compile and load every kernel for `device` now (before CUDA-graph capture, say)."""
        device = torch.device(device if device is not None else "cuda")
        index = device.index if device.index is not None else torch.cuda.current_device()
        return self.modules.for_device(index)

    def persistent_blocks(self, kernel, device: torch.device, entry_point: str | None = None) -> int:
        """SM count x blocks_per_sm (kernels.yaml), clamped to the compiled kernel's occupancy."""
        return self.warm_up(device).persistent_blocks(entry_point or kernel.variants[0][0], kernel.blocks_per_sm)

    def grid(self, kernel, entry_point: str, *, work: int, device: torch.device) -> tuple[int, int]:
        persistent = self.persistent_blocks(kernel, device, entry_point) if kernel.shape == "persistent" else 0
        return blocks_for(kernel, work, threads=kernel.threads, persistent_blocks=persistent), kernel.threads

    def prepared_launch(self, kernel, entry_point: str, *, blocks: int, threads: int, params,
                        device: torch.device):
        return self.warm_up(device).prepared(entry_point, blocks=blocks, threads=threads, params=params)


def create(layer) -> CudaBackend:
    try:
        import cupy
    except ImportError as exc:
        raise BackendUnavailable(f"CuPy is not installed ({exc})") from exc
    if not cupy.is_available():
        raise BackendUnavailable("CuPy sees no CUDA device")
    if not torch.cuda.is_available():
        raise BackendUnavailable("torch sees no CUDA device")
    return CudaBackend(layer)
