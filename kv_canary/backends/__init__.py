"""Tier 2: the backends that run a launch, and the registry that finds them.

A backend lives in `kv_canary.backends.<name>` (`torch`: the generated reference; `cpu`: the
schema's kernels compiled natively for the host, the default on CPU tensors; `emulated`: the
generated CUDA kernels compiled for the host against a CUDA shim; `cuda`: the generated kernels on
a GPU through CuPy) and
exposes `create(tree)`; modules load lazily, so a missing optional dependency (CuPy, a compiler)
only matters when asked for. A backend receives validated arguments (kv_canary.launch validates
first) and must never read or write out of bounds. Its one method, `prepare(operation, args)`,
binds an operation object (kv_canary/launch/operations.py: WRITE, VERIFY, PLAN, PLAN_OFFSETS,
PLAN_ENTRIES, SCATTER; the backend calls what the object says: its `reference` or its
`kernel_launches`) to its arguments and returns a `Prepared` launch. A host backend's
`checks_index_values` says which of the operation's index-value checks run before it.
"""
from __future__ import annotations

import importlib
import threading
from dataclasses import dataclass
from typing import Callable

KNOWN_BACKENDS = ("torch", "cpu", "cuda", "emulated")


class BackendUnavailable(Exception):
    """Raised by a backend's `create(tree)` when it cannot run here; the message says why."""


@dataclass(slots=True)
class Prepared:
    """One operation bound to one set of validated arguments: `run()` launches it, without looking
    at the arguments again (only what the backend reads of their values: the host backends' index
    checks). `launches`: (kernel, entry point, blocks, threads, argument values, the arguments bound)
    of each kernel launch it makes, in order, () for the torch reference (what benchmarks compare
    with a bare call); it keeps every tensor a launch reads alive as long as the launch."""
    run: Callable[[], None]
    args: dict
    launches: tuple = ()


_cache: dict = {}
_lock = threading.Lock()


def get_backend(name: str, tree):
    """The backend `name` for the generated package `tree`, created once per (name, tree)."""
    if name not in KNOWN_BACKENDS:
        raise ValueError(f"kv-canary: unknown backend {name!r}; expected one of {', '.join(KNOWN_BACKENDS)}")
    key = (name, tree.__name__)
    backend = _cache.get(key)
    if backend is not None:  # every launch asks: no lock once it exists
        return backend
    with _lock:
        if key in _cache:
            return _cache[key]
        try:
            module = importlib.import_module(f"{__name__}.{name}")
        except ModuleNotFoundError as exc:
            if exc.name != f"{__name__}.{name}":
                raise ValueError(f"kv-canary: backend '{name}' is not available: missing module {exc.name}") from exc
            raise ValueError(f"kv-canary: backend '{name}' is not available: "
                             f"module kv_canary.backends.{name} is not installed") from None
        try:
            backend = module.create(tree)
        except BackendUnavailable as exc:
            raise ValueError(f"kv-canary: backend '{name}' is not available: {exc}") from exc
        _cache[key] = backend
        return backend
