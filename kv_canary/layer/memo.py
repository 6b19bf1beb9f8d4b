"""One object per generated package, made once per process, held with the package itself: a package
imported again under the same name gets a new object, never one bound to the old tables.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class PerLayer(Generic[T]):
    """`get(layer)`: `make(layer)`'s result for this layer, made on first use (under a lock)."""

    def __init__(self, make: Callable[[object], T]) -> None:
        self._make = make
        self._made: dict[str, tuple[object, T]] = {}
        self._lock = threading.Lock()

    def get(self, layer) -> T:
        with self._lock:
            entry = self._made.get(layer.__name__)
            if entry is None or entry[0] is not layer:
                entry = self._made[layer.__name__] = (layer, self._make(layer))
            return entry[1]
