"""The `torch` backend: the torch reference (kv_canary/backends/reference.py) bound to a tree's layout
(its generated `reference` module, generated/reference.py).

It runs on tensors of any device (the reference copies what it needs to the CPU and writes results
back in place) and appends violation rows in entry order. As a host backend its launches also reject
request rows outside req_to_token / pool_out and a plan-entries scratch that the offsets stage did
not fill for the same batch (the operations' HostChecks, kv_canary/launch/operations.py); the
reference itself raises for SWA indices outside the LUT.
"""
from __future__ import annotations

import importlib

from ..trees.loader import regenerate_command
from . import BackendUnavailable, Prepared


class TorchBackend:
    name = "torch"
    # The operations' index-value checks run before it (kv_canary/launch/operations.py), all but the
    # SWA indices: the reference checks those itself.
    checks_index_values = "all_but_swa"

    def __init__(self, reference):
        self.reference = reference

    def prepare(self, operation, args: dict, *, read: list | None = None) -> Prepared:
        """`operation` (kv_canary/launch/operations.py) on validated `args`: its reference function."""
        fn = operation.reference(self.reference)
        return Prepared(lambda: fn(**args), args)


def create(tree) -> TorchBackend:
    try:
        reference = importlib.import_module(tree.__name__ + ".reference")
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(f"{tree.__name__} has no generated reference module (run "
                                 f"`{regenerate_command(tree)}`)") from exc
    return TorchBackend(reference)
