"""The `emulated` backend: the generated CUDA kernels compiled by g++ and run on the host.

Same sources, same argument packing and same launch shapes as the `cuda` backend, on CPU tensors.
Blocks stay small (EMULATED_THREADS threads, EMULATED_PERSISTENT_BLOCKS blocks for persistent
grids) so that tests are fast while still running several warps and several blocks.

Unlike the `cuda` backend it is a host backend, where reading index tensors costs nothing: like the
torch reference it raises for request rows outside req_to_token / pool_out, for SWA indices
outside the LUT and for a plan-entries scratch the offsets stage did not fill before launching
(host_checks.py), where a GPU kernel can only mark them.
"""
from __future__ import annotations

import threading

import torch

from ..cuda.kernel_backend import KernelBackend, Prepared, blocks_for
from . import BackendUnavailable
from .host_checks import HostChecks

EMULATED_THREADS = 64
EMULATED_PERSISTENT_BLOCKS = 2

_libraries: dict = {}
_lock = threading.Lock()


def library_for(layer):
    """The layer's loaded emulation library: built (or found in the cache) once per process."""
    from ..emulation.build import build_library
    from ..emulation.library import EmulationLibrary
    with _lock:
        lib = _libraries.get(layer.__name__)
        if lib is None or lib.layer is not layer:
            lib = _libraries[layer.__name__] = EmulationLibrary(layer, build_library(layer))
        return lib


class EmulatedBackend(KernelBackend):
    name = "emulated"

    def __init__(self, layer, *, threads: int = EMULATED_THREADS, persistent_blocks: int = EMULATED_PERSISTENT_BLOCKS):
        super().__init__(layer)
        if threads % 32 or not 32 <= threads <= 1024:
            raise ValueError(f"kv-canary: emulated threads per block must be a multiple of 32 in [32, 1024], got {threads}")
        self.threads = threads
        self.persistent_blocks = persistent_blocks
        self.library = library_for(layer)  # eager: a build error surfaces here, not mid-batch
        self.host_checks = HostChecks(layer)

    def check_device(self, device: torch.device) -> None:
        if device.type != "cpu":
            raise ValueError(f"kv-canary: backend 'emulated' runs the kernels on the host and needs CPU tensors, "
                             f"got tensors on {device}")

    # Host checks of the operations that read index values (host_checks.py), before any kernel writes.
    def _plan_checks(self, args: dict) -> None:
        self.host_checks.plan_rows(**args)
        self.host_checks.swa_indices(**args)  # both stages' indices

    def _plan_offsets_checks(self, args: dict) -> None:
        self.host_checks.plan_rows(**args)
        self.host_checks.swa_seed_indices(**args)

    def _plan_entries_checks(self, args: dict) -> None:
        self.host_checks.plan_rows(**args)
        self.host_checks.plan_scratch(**args)
        self.host_checks.swa_entry_indices(**args)

    def _scatter_checks(self, args: dict) -> None:
        self.host_checks.scatter_rows(**args)

    def plan(self, **kwargs) -> None:
        self.check_device(kwargs["req_to_token"].device)
        self._plan_checks(kwargs)
        super().plan(**kwargs)

    def plan_offsets(self, **kwargs) -> None:
        self.check_device(kwargs["req_to_token"].device)
        self._plan_offsets_checks(kwargs)
        super().plan_offsets(**kwargs)

    def plan_entries(self, **kwargs) -> None:
        self.check_device(kwargs["req_to_token"].device)
        self._plan_entries_checks(kwargs)
        super().plan_entries(**kwargs)

    def scatter(self, **kwargs) -> None:
        self.check_device(kwargs["pool_out"].device)
        self._scatter_checks(kwargs)
        super().scatter(**kwargs)

    def prepare(self, operation: str, args: dict, signatures=None) -> Prepared:
        """The kernels' bound launch; the plan, its stages and scatter also read their index values at
        every launch."""
        return self._with_checks(operation, super().prepare(operation, args, signatures))

    def _with_checks(self, operation: str, prepared: Prepared) -> Prepared:
        checks = {"plan": self._plan_checks, "plan_offsets": self._plan_offsets_checks,
                  "plan_entries": self._plan_entries_checks, "scatter": self._scatter_checks}.get(operation)
        if checks is None:
            return prepared

        def run(args: dict) -> None:
            checks(args)
            prepared.run(args)

        def rebind(args: dict, changed: frozenset) -> Prepared:
            return self._with_checks(operation, prepared.rebind(args, changed))
        return Prepared(run, needs_args=True, kernels=prepared.kernels,
                        rebind=rebind if prepared.rebind is not None else None)

    def grid(self, kernel, entry_point: str, *, work: int, device: torch.device) -> tuple[int, int]:
        # Never more threads than kernels.yaml declares: kernels size their shared memory by it.
        threads = min(self.threads, kernel.threads)
        return blocks_for(kernel, work, threads=threads, persistent_blocks=self.persistent_blocks), threads

    def prepared_launch(self, kernel, entry_point: str, *, blocks: int, threads: int, params,
                        device: torch.device):
        return self.library.prepared(entry_point, blocks=blocks, threads=threads, params=params)


def create(layer) -> EmulatedBackend:
    from ..emulation.build import EmulationBuildError
    try:
        return EmulatedBackend(layer)
    except EmulationBuildError as exc:
        raise BackendUnavailable(str(exc)) from exc
