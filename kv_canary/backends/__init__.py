"""Backend registry: `get_backend(name, layer)` returns the object that runs the kernels.

A backend lives in the module `kv_canary.backends.<name>` and exposes `create(layer)`; modules are
imported lazily, so a missing optional dependency (CuPy, a compiler) only matters when asked for.
Backends receive validated inputs (kv_canary.runtime validates first) and must never read or write
out of bounds. A backend has one method per operation of the launch table (codegen/launches.py):
write, verify, plan, plan_offsets, plan_entries and scatter, each taking its validator's keywords.
It may also offer `prepare(operation, args, signatures)`, returning a Prepared launch
(kv_canary/cuda/kernel_backend.py) that the runtime keeps while the inputs keep their signature
(kv_canary/launch_cache.py); without it, the runtime calls the operation itself.
"""
from __future__ import annotations

import importlib
import threading

KNOWN_BACKENDS = ("torch", "cuda", "emulated")


class BackendUnavailable(Exception):
    """Raised by a backend's `create(layer)` when it cannot run here; the message says why."""


_cache: dict = {}
_lock = threading.Lock()


def get_backend(name: str, layer):
    """The backend `name` for the generated package `layer`, created once per (name, layer)."""
    if name not in KNOWN_BACKENDS:
        raise ValueError(f"kv-canary: unknown backend {name!r}; expected one of {', '.join(KNOWN_BACKENDS)}")
    key = (name, layer.__name__)
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
            backend = module.create(layer)
        except BackendUnavailable as exc:
            raise ValueError(f"kv-canary: backend '{name}' is not available: {exc}") from exc
        _cache[key] = backend
        return backend
