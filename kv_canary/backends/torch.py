"""The `torch` backend: the generated torch reference (generated/reference.py) of a layer.

It runs on tensors of any device (the reference copies what it needs to the CPU and writes results
back in place) and appends violation rows in entry order. As a host backend it also rejects request
rows outside req_to_token / pool_out and a plan-entries scratch that the offsets stage did not fill
for the same batch (kv_canary/backends/host_checks.py); the reference itself raises for SWA indices
outside the LUT.
"""
from __future__ import annotations

import importlib

from .._loader import regenerate_command
from . import BackendUnavailable
from .host_checks import HostChecks


class TorchBackend:
    name = "torch"

    def __init__(self, reference, checks: HostChecks):
        self._ref = reference
        self._checks = checks

    def write(self, **kwargs) -> None:
        self._ref.write(**kwargs)

    def verify(self, **kwargs) -> None:
        self._ref.verify(**kwargs)

    def plan(self, **kwargs) -> None:
        self._checks.plan_rows(**kwargs)
        self._ref.plan(**kwargs)

    def plan_offsets(self, **kwargs) -> None:
        self._checks.plan_rows(**kwargs)
        self._ref.plan_offsets(**kwargs)

    def plan_entries(self, **kwargs) -> None:
        self._checks.plan_rows(**kwargs)
        self._checks.plan_scratch(**kwargs)
        self._ref.plan_entries(**kwargs)

    def scatter(self, **kwargs) -> None:
        self._checks.scatter_rows(**kwargs)
        self._ref.scatter(**kwargs)


def create(layer) -> TorchBackend:
    try:
        reference = importlib.import_module(layer.__name__ + ".reference")
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(f"{layer.__name__} has no generated reference module (run "
                                 f"`{regenerate_command(layer)}`)") from exc
    return TorchBackend(reference, HostChecks(layer))
