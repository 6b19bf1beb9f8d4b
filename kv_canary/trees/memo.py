"""One object per generated package, made once per process, held with the package itself: a package
imported again under the same name gets a new object, never one bound to the old tables.
"""
from __future__ import annotations

import threading
from typing import Callable, Generic, TypeVar

T = TypeVar("T")


class PerTree(Generic[T]):
    """`get(tree)`: `make(tree)`'s result for this tree, made on first use (under a lock)."""

    def __init__(self, make: Callable[[object], T]) -> None:
        self._make = make
        self._made: dict[str, tuple[object, T]] = {}
        self._lock = threading.Lock()

    def get(self, tree) -> T:
        with self._lock:
            entry = self._made.get(tree.__name__)
            if entry is None or entry[0] is not tree:
                entry = self._made[tree.__name__] = (tree, self._make(tree))
            return entry[1]
