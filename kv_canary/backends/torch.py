"""The `torch` backend: the torch reference (kv_canary/backends/reference.py) bound to a layer's layout
(its generated `reference` module, generated/reference.py).

It runs on tensors of any device (the reference copies what it needs to the CPU and writes results
back in place) and appends violation rows in entry order. As a host backend it also rejects request
rows outside req_to_token / pool_out and a plan-entries scratch that the offsets stage did not fill
for the same batch (kv_canary/backends/host_checks.py); the reference itself raises for SWA indices
outside the LUT.
"""
from __future__ import annotations

import importlib

from ..layer.loader import regenerate_command
from . import BackendUnavailable, Prepared
from .host_checks import HostChecks


class TorchBackend:
    name = "torch"

    def __init__(self, reference, checks: HostChecks):
        self.reference = reference
        self.checks = checks  # a method per operation that reads index values

    def prepare(self, operation: str, args: dict, *, read: list | None = None) -> Prepared:
        op, checks = getattr(self.reference, operation), getattr(self.checks, operation, None)

        def run() -> None:
            if checks is not None:
                checks(args)
            op(**args)
        return Prepared(run, args)


def create(layer) -> TorchBackend:
    try:
        reference = importlib.import_module(layer.__name__ + ".reference")
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(f"{layer.__name__} has no generated reference module (run "
                                 f"`{regenerate_command(layer)}`)") from exc
    return TorchBackend(reference, HostChecks(layer, swa=False))  # the reference checks its SWA indices itself
