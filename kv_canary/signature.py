"""Everything a launch's checks and binding read from an argument, as one hashable value.

The runtime caches validation and argument binding per launch (kv_canary/launch_cache.py) and must
never reuse a result whose inputs changed. `signature(value)` captures those inputs:

- a tensor: its data pointer, shape, strides, dtype and device (plus its class when it is a torch.Tensor
  subclass): every property a check or a kernel parameter reads, and nothing that changes when
  only the tensor's values change (plans and inputs are refilled in place every step);
- Python scalars (bools, ints, enums, numpy integers, strings, dtypes, devices) by class and value, so
  `True` and `1`, or two equal ints that are distinct objects, compare as the checks see them;
- lists, tuples and mappings element by element (a mutated `real_kv_sources` list is a new key);
- any other object (contexts, plans, RealKvSource, an engine's own context class) by its class and
  every attribute it holds (slots and instance dict), recursively.

A value it cannot describe raises Unsignable; the caller then takes the uncached path, where the
validators produce their usual message. Signatures hold no tensor, so caches never keep device
memory alive.

Two implementations give these guarantees: the native signer (kv_canary/native: the walk in C, the
tensor fields read from the TensorImpl; a launch's whole argument set in about a microsecond) and
the Python one below (`python_signature`, a microsecond per tensor), which signs wherever the
native one cannot be built and the classes the native one hands back (tensor subclasses, other
sequences and mappings). `classify` tells the native walk how to sign each other class, with the
rules `python_signature` follows. Their signatures differ in form, so one process uses one of them
for every key (`signature`, chosen on first use).
"""
from __future__ import annotations

import enum
import operator
from collections.abc import Mapping

import numpy as np
import torch


class Unsignable(Exception):
    """`signature` cannot describe this value (the launch then runs uncached)."""


_Tensor = torch.Tensor


def _tensor(t: torch.Tensor, mask=None) -> tuple:
    ptr = t.data_ptr()
    return (ptr if mask is None else (ptr & mask, ptr == 0), t.shape, t.stride(), t.dtype, t.device)


def _each(values, mask=None) -> tuple:
    """signature() of each value, with tensors and by-value scalars inline (a context or a plan is
    mostly tensors and ints: this runs at every launch)."""
    out = []
    for v in values:
        cls = type(v)
        if cls is _Tensor:
            out.append(_tensor(v, mask))
        elif cls in _BY_VALUE:
            out.append((cls, v))
        else:
            out.append(python_signature(v, mask))
    return tuple(out)


def _none(_, mask=None) -> None:
    return None


def _by_value(value, mask=None) -> tuple:
    return (type(value), value)


def _sequence(value, mask=None) -> tuple:
    return (type(value), _each(value, mask))


def _mapping(value, mask=None) -> tuple:
    return (type(value), tuple((_key(k), python_signature(v, mask)) for k, v in value.items()))


def _key(key):
    return key if type(key) is str else (type(key), key)


_SCALARS = (bool, int, float, str, bytes, enum.Enum, np.generic, torch.dtype, torch.device)
_BY_VALUE = {bool, int, float, str}  # exact classes signed as (class, value); grows with each such class seen

# Exact class -> its signature function, filled on first sight of a class (`_handler_for`).
_HANDLERS: dict = {torch.Tensor: _tensor, type(None): _none, bool: _by_value, int: _by_value, str: _by_value,
                   float: _by_value, tuple: _sequence, list: _sequence, dict: _mapping}


def python_signature(value, mask=None):
    """The Python implementation of `signature`; with `mask`, each tensor's data pointer is kept as
    (address & mask, address == 0) (`python_shape_signature`)."""
    handler = _HANDLERS.get(type(value))
    if handler is None:
        handler = _HANDLERS[type(value)] = _handler_for(type(value))
    return handler(value, mask)


def python_shape_signature(value, pointer_class_bytes: int):
    """The Python implementation of the native sign_shape (kv_canary/native/signing.cpp): the
    signature with each tensor's address reduced to its class modulo `pointer_class_bytes`."""
    if pointer_class_bytes <= 0 or pointer_class_bytes & (pointer_class_bytes - 1):
        raise ValueError(f"kv-canary: pointer_class_bytes must be a power of two, got {pointer_class_bytes}")
    return python_signature(value, pointer_class_bytes - 1)


def _slot_names(cls) -> tuple:
    names = []
    for klass in reversed(cls.__mro__):
        slots = klass.__dict__.get("__slots__", ())
        for name in (slots,) if isinstance(slots, str) else slots:
            if name not in ("__dict__", "__weakref__") and name not in names:
                names.append(name)
    return tuple(names)


def _handler_for(cls):
    if issubclass(cls, torch.Tensor):
        return lambda t, mask=None: (cls, *_tensor(t, mask))
    if issubclass(cls, _SCALARS):
        _BY_VALUE.add(cls)
        return _by_value
    if issubclass(cls, Mapping):
        return _mapping
    if issubclass(cls, (tuple, list)):
        return _sequence
    slots = _slot_names(cls)
    has_dict = cls.__dictoffset__ != 0
    if not slots and not has_dict:
        return _unsignable
    # An unset slot raises AttributeError here: the launch then runs uncached and the validator names it.
    read_slots = operator.attrgetter(*slots) if len(slots) > 1 else (
        (lambda o, get=operator.attrgetter(slots[0]): (get(o),)) if slots else (lambda o: ()))
    if not has_dict:
        return lambda o, mask=None: (cls, _each(read_slots(o), mask))
    return lambda o, mask=None: (cls, _each(read_slots(o), mask),
                                 tuple((k, python_signature(v, mask)) for k, v in vars(o).items()))


def _unsignable(value, mask=None):
    raise Unsignable(f"no signature for a {type(value).__name__}")


# -- the native signer's side (kv_canary/native/signing.cpp) ---------------------------------------------
BY_VALUE, OBJECT, PYTHON, MEMBER = 0, 1, 2, 3  # the kinds signing.cpp knows


def classify(cls) -> tuple:
    """How the native walk signs an instance of `cls` (any class but exact torch.Tensor, None, bool,
    int, float, str, tuple, list and dict, which it signs itself): (kind, slots, has_dict), the same
    rules as `_handler_for`. `slots`: (name, the descriptor `obj.name` resolves to) of each slot,
    which signing.cpp reads at its offset when it is a plain member."""
    if issubclass(cls, torch.Tensor):
        return (PYTHON, None, False)
    if issubclass(cls, enum.Enum):  # equal members of one class are one object (aliases included)
        return (MEMBER, None, False)
    if issubclass(cls, _SCALARS):
        return (BY_VALUE, None, False)
    if issubclass(cls, (Mapping, tuple, list)):
        return (PYTHON, None, False)
    names = _slot_names(cls)
    has_dict = cls.__dictoffset__ != 0
    if not names and not has_dict:
        return (PYTHON, None, False)  # python_signature raises Unsignable
    slots = tuple((name, next(k.__dict__[name] for k in cls.__mro__ if name in k.__dict__)) for name in names)
    return (OBJECT, slots or None, has_dict)


def configure_native(module) -> None:
    """Hand the native module torch.Tensor, `classify` and the Python fallback."""
    module.configure(torch.Tensor, classify, python_signature)


def signature(value):
    """The hashable description of `value` that cached launches are keyed on (module docstring)."""
    return signer()(value)


def signer():
    """The function `signature` uses in this process: the native module's `sign` or `python_signature`."""
    global _signer, _shape_signer
    if _signer is None:
        from .native import signer as native_signer
        module, _ = native_signer()
        _signer = module.sign if module is not None else python_signature
        _shape_signer = module.sign_shape if module is not None else None
    return _signer


def shape_signer_for(sign):
    """The shape signer matching `sign`: the native module's sign_shape for its sign,
    python_shape_signature for python_signature, None for any other."""
    signer()
    if sign is python_signature:
        return python_shape_signature
    return _shape_signer if sign is _signer and _shape_signer is not None else None


_signer = _shape_signer = None
