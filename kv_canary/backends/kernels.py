"""What the `cuda`, `cpu` and `emulated` backends share: an operation (kv_canary/launch/operations.py,
whose `kernel_launches` names its kernels and work sizes) as launches of the generated kernels.

Which variant and every argument value: decided here, from the tree's generated kernel
ABI (generated/kernel_abi.py: each kernel's parameters as typed data, rendered from the same parameter
list as the CUDA signature; `KERNELS[name].bind(arguments[, read])`, compiled from them by
kv_canary/backends/binder.py, returns a kernel's arguments in ABI order). Subclasses say how big a grid
is and how a launch of those values runs (`launcher`: CuPy's kernel call on a GPU, the emulation
library's packed-argument entry point on the host).

Inputs arrive validated (kv_canary.launch); the kernels themselves keep every access in bounds.
Nothing here synchronises with the device: sizes come from tensor shapes, never tensor values.
"""
from __future__ import annotations

import struct
from typing import Callable

import torch

from ..trees.loader import regenerate_command
from ..trees.sources import kernel_abi
from . import Prepared


class KernelBackend:
    """write / verify / plan (plan_offsets + plan_entries) / scatter on the generated kernels of one tree."""

    name = "kernels"
    # Which of the operations' index-value checks run before its kernels ("all" on a host backend,
    # which reads index values for free; None on a GPU: kv_canary/launch/operations.py HostChecks).
    checks_index_values: str | None = None

    def __init__(self, tree):
        self.tree = tree
        self.layout = tree.layout
        self.abi = kernel_abi(tree)
        if self.abi.LAYOUT_FINGERPRINT != self.layout.LAYOUT_FINGERPRINT or self.abi.ABI_VERSION != self.layout.ABI_VERSION:
            raise ValueError(f"kv-canary: {tree.__name__}.kernel_abi (fingerprint {self.abi.LAYOUT_FINGERPRINT}) and "
                             f"layout (fingerprint {self.layout.LAYOUT_FINGERPRINT}) come from different schemas; "
                             f"run `{regenerate_command(tree)}`")
        self.kernels = {operation: self.abi.kernel_for_operation(operation) for operation in self.abi.KERNEL_OPERATIONS}
        self._entry_points: dict = {}  # (kernel, flags) -> the entry point compiled for them

    # -- hooks ----------------------------------------------------------------------------------
    def check_device(self, device: torch.device) -> None:
        raise NotImplementedError

    def grid(self, kernel, entry_point: str, *, work: int, device: torch.device) -> tuple[int, int]:
        """(blocks, threads) of one launch; `work` = the requests or entries the grid covers (blocks_for)."""
        raise NotImplementedError

    def launcher(self, kernel, entry_point: str, *, blocks: int, threads: int, values: tuple,
                 device: torch.device) -> Callable[[], None]:
        """A function of no arguments launching `entry_point` with `values` (ABI order)."""
        raise NotImplementedError

    # -- binding --------------------------------------------------------------------------------
    def entry_point(self, kernel, **flags) -> str:
        key = (kernel.name, *flags.items()) if flags else kernel.name
        entry = self._entry_points.get(key)
        if entry is None:
            entry = self._entry_points[key] = self._entry_point(kernel, **flags)
        return entry

    def _entry_point(self, kernel, **flags) -> str:
        declared = {name for _, variant in kernel.variants for name, _ in variant}
        for flag, value in flags.items():
            if flag not in declared and value:
                raise ValueError(f"kv-canary: kernel {kernel.name} is not specialised for {flag}=True; declare "
                                 f"`specializations: {{{flag}: [false, true]}}` for it in kernels.yaml")
        return kernel.entry_point(**{k: bool(v) for k, v in flags.items() if k in declared})

    def bound(self, operation: str, args, *, work: int, device: torch.device, read: list | None = None,
              values: tuple | None = None, **flags) -> tuple:
        """(kernel, entry point, blocks, threads, values, args) of one kernel launch over `args` (kept
        with the launch: the values hold their tensors' addresses, not the tensors); `read`: what
        validation read of the real-KV sources (a kernel with a real-KV block); `values`: the launch's
        values already bound (the plan's stages, PLAN.bind)."""
        kernel = self.kernels[operation]
        entry = self.entry_point(kernel, **flags)
        blocks, threads = self.grid(kernel, entry, work=work, device=device)
        if values is None:
            values = kernel.bind(args) if kernel.real_kv is None else kernel.bind(args, read)
        return kernel, entry, blocks, threads, values, args

    def prepare(self, operation, args: dict, *, read: list | None = None) -> Prepared:
        """`operation` (an object of kv_canary/launch/operations.py; validated `args`) bound to its
        kernel launches (`operation.kernel_launches`), the kernels alone (an operation adds its
        index-value checks on a host backend); `read`: what the validators read of the real-KV
        sources (write, verify: the binding takes them instead of reading the tensors again)."""
        device, stages = operation.kernel_launches(self, args, read)
        runs = [self.launcher(kernel, entry, blocks=blocks, threads=threads, values=values, device=device)
                for kernel, entry, blocks, threads, values, _ in stages]
        if len(runs) == 1:
            run = runs[0]  # the launch holds its values; `stages` below holds the tensors
        else:
            def run(_stages=stages) -> None:  # _stages: the run keeps every tensor it reads alive (the plan's scratch)
                for launch in runs:  # none for a scatter of no request (a zero-sized grid is not a launch)
                    launch()
        return Prepared(run, args, tuple(stages))

    def device_of(self, tensor: torch.Tensor) -> torch.device:
        """The device of the launch's device tensor, checked for this backend (an operation's kernel_launches)."""
        device = tensor.device
        self.check_device(device)
        return device


def blocks_for(kernel, work: int, *, threads: int, persistent_blocks: int) -> int:
    """Grid size of one launch for the kernel's launch shape (kernels.yaml)."""
    if kernel.shape in ("per_request", "per_entry"):
        return max(1, -(-work // threads))
    if kernel.shape == "block_per_request":
        # One block per request of the plan's capacity (the active count lives on the device, so
        # blocks past it exit at once: no host sync, and a captured graph stays valid).
        return max(1, work)
    if kernel.shape == "single_block":
        return 1
    if kernel.shape == "persistent":
        # Never more blocks than the entries can fill (work = the plan's capacity, a host-side
        # upper bound of the active entries): small verifies launch small grids.
        return max(1, min(persistent_blocks, -(-work // threads)))
    if kernel.shape == "fixed_grid":
        return kernel.blocks
    raise ValueError(f"kv-canary: kernel {kernel.name} has unknown launch shape {kernel.shape!r}")


SLOT_BYTES = 8
# How struct packs each parameter kind into its 8-byte slot (the host backends' packed arguments,
# little-endian): the value's two's complement bits; a 32-bit int in the slot's low bytes.
SLOT_FORMATS = {"ptr": "Q", "i64": "q", "i32": "i4x"}


def packer(kinds: tuple) -> struct.Struct:
    """Packs a launch's values into slots (as bytes: immutable, ctypes passes their buffer as it is)."""
    return struct.Struct(("<" + "".join(SLOT_FORMATS[k] for k in kinds)) if kinds else f"<{SLOT_BYTES}x")
