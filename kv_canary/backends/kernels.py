"""What the `cuda` and `emulated` backends share: docs/semantics.md's operations (write, verify, plan and
its two stages, scatter) as launches of the generated kernels.

Which kernel, which variant, every argument value: decided here, from the layer's generated kernel
ABI (generated/kernel_abi.py: `KERNELS[name].bind(arguments[, kv])` returns a kernel's arguments in ABI
order, rendered from the same parameter list as the CUDA signature). Subclasses say how big a grid
is and how a launch of those values runs (`launcher`: CuPy's kernel call on a GPU, the emulation
library's packed-argument entry point on the host).

Inputs arrive validated (kv_canary.launch); the kernels themselves keep every access in bounds.
Nothing here synchronises with the device: sizes come from tensor shapes, never tensor values.
"""
from __future__ import annotations

import struct
from typing import Callable

import torch

from ..layer.loader import regenerate_command
from ..layer.sources import kernel_abi
from . import Prepared


class KernelBackend:
    """write / verify / plan (plan_offsets + plan_entries) / scatter on the generated kernels of one layer."""

    name = "kernels"

    def __init__(self, layer):
        self.layer = layer
        self.layout = layer.layout
        self.abi = kernel_abi(layer)
        if self.abi.LAYOUT_FINGERPRINT != self.layout.LAYOUT_FINGERPRINT or self.abi.ABI_VERSION != self.layout.ABI_VERSION:
            raise ValueError(f"kv-canary: {layer.__name__}.kernel_abi (fingerprint {self.abi.LAYOUT_FINGERPRINT}) and "
                             f"layout (fingerprint {self.layout.LAYOUT_FINGERPRINT}) come from different schemas; "
                             f"run `{regenerate_command(layer)}`")
        self.kernels = {template: self.abi.kernel_for_template(template) for template in self.abi.KERNEL_OPERATIONS}
        self._entry_points: dict = {}  # (kernel, flags) -> the entry point compiled for them
        self._operations = {op: getattr(self, "_" + op) for op in (*self.abi.KERNEL_OPERATIONS, "plan")}

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

    def checks(self, operation: str) -> Callable | None:
        """The value checks a host backend makes at every run of `operation` (None: none)."""
        return None

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

    def bound(self, template: str, args, *, work: int, device: torch.device, kv: tuple | None = None,
              values: tuple | None = None, **flags) -> tuple:
        """(kernel, entry point, blocks, threads, values, args) of one kernel launch over `args` (kept
        with the launch: the values hold their tensors' addresses, not the tensors); `values`: the
        launch's values already bound (the plan's stages, bind_plan)."""
        kernel = self.kernels[template]
        entry = self.entry_point(kernel, **flags)
        blocks, threads = self.grid(kernel, entry, work=work, device=device)
        if values is None:
            values = kernel.bind(args) if kv is None else kernel.bind(args, kv)
        return kernel, entry, blocks, threads, values, args

    def prepare(self, operation: str, args: dict, *, host_checks: bool = True, read: list | None = None) -> Prepared:
        """`operation` (validated `args`) bound to its kernel launches; `host_checks=False` leaves out
        a host backend's value checks (what the kernels alone do with such values, as on a GPU);
        `read`: what the validators read of the real-KV sources (write, verify; real_kv_args)."""
        device, stages = self._operations[operation](args) if read is None else self._operations[operation](args, read)
        runs = [self.launcher(kernel, entry, blocks=blocks, threads=threads, values=values, device=device)
                for kernel, entry, blocks, threads, values, _ in stages]
        checks = self.checks(operation) if host_checks else None
        if checks is None and len(runs) == 1:
            run = runs[0]  # the launch holds its values; `stages` below holds the tensors
        else:
            def run(_stages=stages) -> None:  # _stages: the run keeps every tensor it reads alive (the plan's scratch)
                if checks is not None:
                    checks(args)
                for launch in runs:  # none for a scatter of no request (a zero-sized grid is not a launch)
                    launch()
        return Prepared(run, args, tuple(stages))

    # -- the operations: (device, [bound kernel launch, ...]) -----------------------------------
    def _device(self, tensor: torch.Tensor) -> torch.device:
        device = tensor.device
        self.check_device(device)
        return device

    def _write(self, args: dict, read: list | None = None):
        device = self._device(args["context"].canary_buf)
        kv = self.abi.real_kv_args(args["context"], read)
        return device, [self.bound("write", args, kv=kv, work=int(args["plan"].write_seed_slot_indices.shape[0]),
                                   device=device)]

    def _verify(self, args: dict, read: list | None = None):
        device = self._device(args["context"].canary_buf)
        kv = self.abi.real_kv_args(args["context"], read)
        return device, [self.bound("verify", args, kv=kv, work=int(args["plan"].verify_slot_indices.shape[0]),
                                   device=device, check_verify_expected_token=args["check_verify_expected_token"])]

    def _plan_offsets(self, args: dict):
        device = self._device(args["req_to_token"])
        return device, [self.bound("plan_offsets", args, work=int(args["req_pool_indices"].shape[0]), device=device)]

    def _plan_entries(self, args: dict):
        device = self._device(args["req_to_token"])
        return device, [self.bound("plan_entries", args, work=int(args["out_verify_slot_indices"].shape[0]),
                                   device=device)]

    def _scatter(self, args: dict):
        device = self._device(args["pool_out"])
        bs = int(args["req_pool_indices"].shape[0])
        return device, ([self.bound("scatter", args, work=bs, device=device)] if bs else [])

    def _plan(self, args: dict):
        """The two stages, as SGLang's launch_canary_plan_kernels calls them, bound over a scratch of
        bs + 1 verify offsets that the first writes and the second reads (allocated once per binding:
        a prepared plan launched twice reuses it, stream-ordered, like any other buffer it binds)."""
        device = self._device(args["req_to_token"])
        bs = int(args["req_pool_indices"].shape[0])
        scratch = args["req_pool_indices"].new_empty(bs + 1)  # int64 on its device; new_empty: half torch.empty's cost
        offsets, entries = self.abi.bind_plan(args, scratch)  # the stages' values, as plan_stage_args would bind them
        held = (args, scratch)  # what the stages' values point into
        return device, [self.bound("plan_offsets", held, values=offsets, work=bs, device=device),
                        self.bound("plan_entries", held, values=entries, device=device,
                                   work=int(args["verify_plan_out"].verify_slot_indices.shape[0]))]


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
