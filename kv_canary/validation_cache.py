"""Validators whose per-context and per-plan checks run once per argument signature.

A launch's `validate_<operation>` (kv_canary/validation.py) checks the context (every buffer, ring,
counter and real-KV source) and the plan (every array) again at every call, although an engine
hands the same ones to every step. `CachedValidators` runs each of MEMOIZED once per signature of
its arguments (kv_canary/signature.py: pointers, shapes, strides, dtypes, devices, scalar values,
the attributes of objects) and returns the remembered result while the signature stays the same. A
changed input is a new signature, so the check runs again and raises its usual message; failures
are never remembered. The checks themselves are the base class's, unchanged.

Only plain results (int, bool, None) are remembered: a check that starts returning an object runs
every time instead of handing out a stale one.
"""
from __future__ import annotations

import threading
from contextlib import contextmanager

from .signature import signature
from .validation import Validators

MEMOIZED = ("check_context", "check_verify_plan", "check_write_plan")
MEMO_SIZE = 4096  # remembered signatures per layer; the oldest is dropped beyond it
_MISS = object()


def _memoized(name: str):
    check = getattr(Validators, name)

    def cached(self, *args, **kwargs):
        try:
            key = (name, tuple(map(self._signature, args)), tuple((k, self._signature(v)) for k, v in kwargs.items()))
            result = self._memo.get(key, _MISS)
        except Exception:  # no signature (or an unhashable one): check uncached, the check names the problem
            return check(self, *args, **kwargs)
        if result is _MISS:
            result = check(self, *args, **kwargs)
            if result is None or type(result) in (int, bool):
                if len(self._memo) >= MEMO_SIZE:
                    self._memo.pop(next(iter(self._memo), None), None)  # pop: another thread may have dropped it
                self._memo[key] = result
        return result

    cached.__name__ = cached.__qualname__ = name
    cached.__doc__ = check.__doc__
    return cached


class CachedValidators(Validators):
    """Validators (kv_canary/validation.py) with MEMOIZED remembered per signature."""

    def __init__(self, layout, *, sign=None):
        super().__init__(layout)
        self._sign = sign if sign is not None else signature  # the runtime's signer (one form per cache)
        self._memo: dict = {}
        self._known = threading.local()

    @contextmanager
    def known_signatures(self, signatures: dict):
        """Within the block, an argument whose id() is in `signatures` ({id: signature}, computed by
        the caller for objects it holds) is not signed again."""
        self._known.ids = signatures
        try:
            yield
        finally:
            self._known.ids = None

    def _signature(self, value):
        known = getattr(self._known, "ids", None)
        if known is not None:
            sig = known.get(id(value), _MISS)
            if sig is not _MISS:
                return sig
        return self._sign(value)

    def forget(self) -> None:
        """Drop every remembered result (the next checks run in full)."""
        self._memo.clear()


for _name in MEMOIZED:
    setattr(CachedValidators, _name, _memoized(_name))
