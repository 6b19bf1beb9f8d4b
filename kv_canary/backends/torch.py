"""The `torch` backend: the generated torch reference (generated/reference.py) of a layer.

It runs on tensors of any device (the reference copies what it needs to the CPU and writes results
back in place) and appends violation rows in entry order.
"""
from __future__ import annotations

import importlib

from . import BackendUnavailable


class TorchBackend:
    name = "torch"

    def __init__(self, reference):
        self._ref = reference

    def write(self, **kwargs) -> None:
        self._ref.write(**kwargs)

    def verify(self, **kwargs) -> None:
        self._ref.verify(**kwargs)

    def plan(self, **kwargs) -> None:
        self._ref.plan(**kwargs)

    def scatter(self, **kwargs) -> None:
        self._ref.scatter(**kwargs)


def create(layer) -> TorchBackend:
    try:
        reference = importlib.import_module(layer.__name__ + ".reference")
    except ModuleNotFoundError as exc:
        raise BackendUnavailable(f"{layer.__name__} has no generated reference module (run `make generate`)") from exc
    return TorchBackend(reference)
