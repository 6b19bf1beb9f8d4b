"""The host side of one public launch, done once per set of inputs and reused while they stay the same.

A launch validates its arguments (kv_canary/validation.py), chooses a backend (kv_canary/runtime.py)
and binds the kernel's arguments (kv_canary/cuda/kernel_backend.py). All three depend only on what
`signature` (kv_canary/signature.py) captures of the arguments: data pointers, shapes, strides,
dtypes and devices of tensors, the values of scalars, the attributes of contexts and plans. So a
LaunchPath keys the result of that work on the signatures of all arguments plus the `backend=`
keyword and the KV_CANARY_BACKEND variable, and a launch whose key was seen before only runs its
prepared launch: for the kernel backends one call with arguments packed at binding time, for the
torch backend the reference on the current tensors.

A changed input is a different key: the whole path runs again, so every check still fires before
the launch, with its usual message, and errors are never cached. On such a miss the validators'
per-context and per-plan checks (kv_canary/validation_cache.py) and the kernels' per-argument
binding parts are still reused where their own inputs did not change. Checks that read tensor
values (the host backends' index checks) run at every launch, inside the prepared launch.
Arguments without a signature (not a tensor, scalar, container or plain object) always take the
uncached path.

An engine that builds its batch tensors afresh every step (new addresses, same shapes) misses at
every step. For that, a LaunchPath also keys each validated launch on its *shape signature* (the
signer's sign_shape: the same walk with each data pointer reduced to its address modulo
the validators' pointer_class_bytes and whether it is null). The checks read nothing else of an
address (Validators.address_misaligned, held to it by a test), so a miss whose shape signature was
validated before passes them unchanged: validation and backend choice are skipped, and only the
parameters read from the arguments that moved are bound again (Prepared.rebind). The Python signer
has its shape signature too (python_shape_signature).
"""
from __future__ import annotations

import functools
import operator
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Callable, Optional

from .cuda.kernel_backend import Prepared

ENTRIES = 256  # cached launches per operation; the oldest is dropped beyond it
_ABSENT = object()


@functools.lru_cache(maxsize=None)
def _getter(path: str):
    """`context.canary_buf` -> a function of the launch arguments returning that value."""
    head, _, rest = path.partition(".")
    attr = operator.attrgetter(rest) if rest else None
    return lambda args: attr(args[head]) if attr else args[head]


@dataclass(frozen=True)
class Entry:
    """A prepared launch and, when its run reads the arguments, how to rebuild the validated
    arguments from the raw ones of a launch with the same key."""
    prepared: Prepared
    rebuild: Optional[Callable[[dict], dict]]


@dataclass
class Shape:
    """A validated launch shape: the backend chosen for it, how its validated arguments follow from
    the raw ones (for any launch with the same shape signature), and the last launch bound for it
    with its arguments' signatures (a new launch rebinds only what differs from it)."""
    backend: object
    rebuild: Callable[[dict], dict]
    torch_run: Optional[Prepared]  # the reference's Prepared (needs no binding), else None
    last: tuple = ({}, None)       # (signatures, Prepared), replaced whole (one atomic store)


def derive_rebuild(arguments: dict, validated: dict) -> Optional[Callable[[dict], dict]]:
    """How `validated` (what validate_<operation> returned) follows from `arguments`, as a function
    of any arguments with the same signatures; None when it does not follow plainly (a validator
    returned a new tensor, say), and the launch is then not cached."""
    steps = []
    for name, value in validated.items():
        given = arguments.get(name, _ABSENT)
        if given is value:
            steps.append((name, "pass", None))
        elif type(value) is dict and _rekeyed(given, value):
            steps.append((name, "keys", tuple(value)))  # a mapping normalised to the schema's keys
        elif value is None or type(value) in (bool, int, str):
            steps.append((name, "const", value))
        else:
            return None
    try:
        return _compile_rebuild(tuple(steps))
    except TypeError:  # an unhashable constant: compile this one afresh
        return _compile_rebuild.__wrapped__(tuple(steps))


@functools.lru_cache(maxsize=1024)
def _compile_rebuild(steps: tuple) -> Callable[[dict], dict]:
    """The steps as one function returning a dict display: it runs at every launch of the torch
    backend, where a loop over the steps would cost more than the rest of the cached launch. Every
    name, key and constant reaches the code through its namespace, never through its text. Compiled
    once per distinct steps (a launch whose inputs change every step reuses it)."""
    namespace, items, prelude = {}, [], []
    for i, (name, how, what) in enumerate(steps):
        namespace[f"_n{i}"] = name
        if how == "pass":
            items.append(f"_n{i}: a[_n{i}]")
        elif how == "keys":
            prelude.append(f"    g{i} = a.get(_n{i})")
            keys = []
            for j, key in enumerate(what):
                namespace[f"_k{i}_{j}"] = key
                keys.append(f"_k{i}_{j}: g{i}[_k{i}_{j}]")
            items.append(f"_n{i}: {{{', '.join(keys)}}}")
        else:
            namespace[f"_c{i}"] = what
            items.append(f"_n{i}: _c{i}")
    source = "\n".join(["def rebuild(a):", *prelude, f"    return {{{', '.join(items)}}}"])
    exec(compile(source, "<kv-canary rebuild>", "exec"), namespace)  # noqa: S102 - text built above, no user data
    return namespace["rebuild"]


def _rekeyed(given, value: dict) -> bool:
    """`value` holds exactly `given`'s objects under `value`'s keys (None or absent: nothing)."""
    if given is None or given is _ABSENT:
        return not value
    return isinstance(given, Mapping) and all(k in given and given[k] is v for k, v in value.items())


def _environ_key(name: str):
    """os.environ's own key for `name`, to read it from os.environ's dict: os.environ.get raises and
    catches a KeyError for an unset name, microseconds per launch. None where os.environ differs."""
    try:
        key = os.environ.encodekey(name)
        os.environ._data.get(key)
        return key
    except Exception:  # another os.environ implementation: use its public interface
        return None


class LaunchPath:
    """Validation, backend choice and binding of one operation, cached per argument signatures."""

    def __init__(self, runtime, operation: str, device_of: str, *, choose_backend: Callable, env_backend: str):
        self.runtime = runtime
        self.operation = operation
        self.choose_backend = choose_backend  # (backend=, device) -> backend name; reads env_backend
        self.env_backend = env_backend
        self._env_key = _environ_key(env_backend)
        self._env_get = os.environ._data.get if self._env_key is not None else None
        self.validate = getattr(runtime.validators, "validate_" + operation)
        self.device_of = _getter(device_of)
        self._sign = runtime.sign  # the native signer where it is built (kv_canary/native), else the Python one
        pointer_class = runtime.validators.pointer_class_bytes
        self._sign_shape = (functools.partial(_sign_shape, runtime.sign_shape, pointer_class)
                            if runtime.sign_shape is not None and pointer_class else None)  # None: full keys only
        self._entries: dict = {}
        self._shapes: dict = {}

    def bind(self, backend, arguments: dict) -> tuple[Entry, Optional[dict]]:
        """Everything a launch does before its kernel call: (the entry, the arguments its run takes)."""
        try:
            # One signature of the whole argument dict (names and values): one native call per launch.
            key = (backend, self._env_get(self._env_key) if self._env_get else os.environ.get(self.env_backend),
                   self._sign(arguments))
            entry = self._entries.get(key)
        except Exception:  # an argument without a (hashable) signature: the uncached path names it
            key = entry = None
        if entry is None:
            return self._prepare(key, backend, arguments)
        return entry, (entry.rebuild(arguments) if entry.rebuild is not None else None)

    def _prepare(self, key, backend, arguments: dict) -> tuple[Entry, Optional[dict]]:
        rt = self.runtime
        signatures = shape_key = None
        if key is not None:
            if self._sign_shape is not None:
                shape_key = (key[0], key[1], self._sign_shape(arguments))
                shape = self._shapes.get(shape_key)
                if shape is not None:
                    return self._rebind(key, shape, arguments)
            # each argument's own signature: the parts of the work that are reused per argument
            signatures = self._signatures(arguments)
        known = {id(arguments[name]): sig for name, sig in signatures.items()} if signatures else {}
        with rt.validators.known_signatures(known):
            args = self.validate(**arguments)
        chosen = rt.backend(self.choose_backend(backend, self.device_of(args).device))
        torch_run = None
        if hasattr(type(chosen), "prepare"):
            prepared = chosen.prepare(self.operation, args, signatures)
        else:
            run = getattr(chosen, self.operation)
            prepared = torch_run = Prepared(lambda a: run(**a), needs_args=True)
        rebuild = derive_rebuild(arguments, args) if key is not None else None
        entry = Entry(prepared, rebuild if prepared.needs_args else None)
        if key is not None and (rebuild is not None or not prepared.needs_args):
            _put(self._entries, key, entry)
        if shape_key is not None and rebuild is not None:
            _put(self._shapes, shape_key, Shape(chosen, rebuild, torch_run, (signatures, prepared)))
        return entry, (args if prepared.needs_args else None)

    def _rebind(self, key, shape: Shape, arguments: dict) -> tuple[Entry, Optional[dict]]:
        """A miss whose shape was validated: the validated arguments rebuilt, the kernels bound (only
        the parameters read from arguments whose signature differs from the shape's last launch)."""
        args = shape.rebuild(arguments)
        if shape.torch_run is not None:  # the reference binds nothing: no per-argument signature needed
            prepared = shape.torch_run
        else:
            signatures = self._signatures(arguments)
            last_signatures, last = shape.last
            if last is not None and last.rebind is not None:
                changed = frozenset(name for name, sig in signatures.items() if last_signatures.get(name) != sig)
                prepared = last.rebind(args, changed)
            else:
                prepared = shape.backend.prepare(self.operation, args, signatures)
            shape.last = (signatures, prepared)
        entry = Entry(prepared, shape.rebuild if prepared.needs_args else None)
        _put(self._entries, key, entry)
        return entry, (args if prepared.needs_args else None)

    def _signatures(self, arguments: dict) -> dict:
        return {name: self._sign(value) for name, value in arguments.items()}

    def forget(self) -> None:
        self._entries.clear()
        self._shapes.clear()


def _sign_shape(sign_shape, pointer_class: int, arguments: dict):
    return sign_shape(arguments, pointer_class)


def _put(table: dict, key, value) -> None:
    if len(table) >= ENTRIES:
        table.pop(next(iter(table), None), None)  # pop: another thread may have dropped the oldest first
    table[key] = value
