"""The runtime of one generated tree (the default one or any other schema's): its validators,
allocators and backends, and its prepared launches.

A generated tree's public functions (generated/api.py, rendered from the launch table in
codegen/launches.py: SGLang's exact keyword-only signatures plus `backend=`) each call their
operation object (kv_canary/launch/operations.py): `WRITE.launch(runtime, backend, arguments)`,
which does, at every call:

1. `WRITE.validate(runtime.validators, arguments)`: every check, from shapes, dtypes, storages and
   Python values only (the write's own, kv_canary/launch/operations.py, over the generic tensor rules
   and scalar helpers of kv_canary/launch/rules.py; kv_canary/launch/validation.py checks the launch
   data classes); it returns the backend operation's keywords;
2. the backend (`runtime.chosen`, else `Runtime.choose`): the `backend=` keyword, else the
   KV_CANARY_BACKEND environment variable, else the tensors' device (CUDA tensors -> `cuda` when
   CuPy sees a device, otherwise `torch`; CPU tensors -> `cpu`, the kernels compiled for the host,
   or, where that backend cannot be built (no compiler, a failed build), the torch reference, after
   one warning naming the cause);
3. `backend.prepare(WRITE, args).run()` (kv_canary/backends/).

`Runtime.bind(name, **arguments)` stops before the run: a `PreparedLaunch` that launches the same
kernels again and again without looking at its arguments (what an engine with fixed buffers wants,
and what a CUDA graph captures); `rebind(**changed)` names the arguments that changed and checks the
whole launch again.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from ..backends import KNOWN_BACKENDS, Prepared, get_backend
from ..trees.memo import PerTree
from . import operations
from .allocation import allocators_for
from .operations import ENV_BACKEND
from .validation import Validators


@functools.lru_cache(maxsize=1)
def cupy_sees_a_device() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver or no device: the torch reference runs instead
        return False


def choose_backend(backend: str | None, device: torch.device) -> str:
    return _choose(backend, device)[0]


def _choose(backend: str | None, device: torch.device) -> tuple[str, bool]:
    """(backend name, whether the device chose it: no backend= and no KV_CANARY_BACKEND)."""
    name = backend if backend is not None else (os.environ.get(ENV_BACKEND) or None)
    if name is None:
        if device.type == "cpu":
            return "cpu", True
        return ("cuda" if device.type == "cuda" and cupy_sees_a_device() else "torch"), True
    if name not in KNOWN_BACKENDS:
        source = "backend=" if backend is not None else f"{ENV_BACKEND}="
        raise ValueError(f"kv-canary: {source}{name!r} is not a backend; expected one of {', '.join(KNOWN_BACKENDS)}")
    if name == "cuda" and device.type != "cuda":
        raise ValueError(f"kv-canary: backend 'cuda' needs CUDA tensors, got tensors on {device}")
    return name, False


class PreparedLaunch:
    """One public launch validated and bound (Runtime.bind). Calling it (or `run()`) launches the
    bound kernels; it never looks at its arguments again, so it is for buffers whose shapes and
    storage stay as they were (refilled in place): a tensor moved after binding (`set_`, a resized
    storage) is not seen, and must be bound again. `rebind(**changed)`: the same launch with the
    named arguments replaced, validated and bound again as a whole (every free-function launch is
    validated as a whole too, a context's tensors included, so there a moved tensor is refused)."""

    def __init__(self, runtime: "Runtime", name: str, backend, arguments: dict):
        self.runtime, self.name, self.backend, self.arguments = runtime, name, backend, arguments
        self.prepared: Prepared = runtime.launches[name].prepare(runtime, backend, arguments)
        self.run = self.prepared.run

    def __call__(self) -> None:
        self.run()

    def rebind(self, **changed) -> "PreparedLaunch":
        unknown = sorted(set(changed) - set(self.arguments))
        if unknown:
            raise TypeError(f"kv-canary: {self.name} has no argument {', '.join(unknown)} to rebind; its arguments "
                            f"are {', '.join(self.arguments)}")
        return PreparedLaunch(self.runtime, self.name, self.backend, {**self.arguments, **changed})


class Runtime:
    """The launches, validators and allocators of one generated tree."""

    def __init__(self, tree):
        self.tree = tree
        self.api = tree.api   # the tree's generated public API module, with its per-schema signatures
        self.validators = Validators(tree.layout, operations=operations.BY_NAME.values())
        self.allocators = allocators_for(tree.layout, self.validators)
        # public launch name -> its operation object (the generated table names it)
        self.launches = {name: operations.BY_NAME[op] for name, op in tree.api.LAUNCHES.items()}
        self.operations = operations  # what the generated api launches (its WRITE, VERIFY, ...)
        # (backend=, device) or (KV_CANARY_BACKEND, device, None) -> the backend chosen for them
        # (Operation.prepare reads it, Runtime.choose fills it)
        self.chosen: dict = {}
        # A host backend's checks_index_values -> the HostChecks its operations make before its kernels
        self.host_checks = {"all": operations.HostChecks(tree), "all_but_swa": operations.HostChecks(tree, swa=False)}
        self._cpu_unavailable = False  # the cpu backend could not be built: CPU tensors get the torch reference

    def backend(self, name: str):
        return get_backend(name, self.tree)

    def choose(self, backend: str | None, device: torch.device, key: tuple):
        """backend_for, remembered under `key` for the launches that follow (Operation.prepare: the
        backend= keyword and the device, or, without the keyword, KV_CANARY_BACKEND and the device)."""
        chosen = self.chosen[key] = self.backend_for(backend, device)
        return chosen

    def backend_for(self, backend: str | None, device: torch.device):
        """The backend a launch on `device` runs on (`backend`: the backend= keyword or None)."""
        name, by_default = _choose(backend, device)
        if by_default and name == "cpu":
            return self._default_host_backend()
        return self.backend(name)

    def _default_host_backend(self):
        """The cpu backend, or, where it cannot be built, the torch reference: said once, with the cause."""
        if not self._cpu_unavailable:
            try:
                return self.backend("cpu")
            except ValueError as exc:
                self._cpu_unavailable = True
                warnings.warn(f"{exc}; CPU tensors run on the torch reference instead (name a backend with backend= "
                              f"or {ENV_BACKEND}=torch to silence this)", RuntimeWarning, stacklevel=5)
        return self.backend("torch")

    def bind(self, name: str, **arguments) -> PreparedLaunch:
        """The public launch `name` validated and bound, not launched (PreparedLaunch)."""
        if name not in self.launches:
            raise ValueError(f"kv-canary: {self.tree.__name__} has no launch named {name!r}; "
                             f"launches are {', '.join(self.launches)}")
        return PreparedLaunch(self, name, arguments.pop("backend", None), arguments)

    def compute_slot_hash(self, buf_i64, source_slot_idx) -> int:
        """SGLang's compute_slot_hash: the link of one slot (u64), HEAD for a negative slot."""
        args = self.validators.validate_slot_hash(buf_i64=buf_i64, source_slot_idx=source_slot_idx)
        return self.tree.reference.compute_slot_hash(**args)

    def use_torch_reference(self, device, *, backend=None) -> bool:
        """SGLang's predicate, answered by the launches' own backend choice (backend_for)."""
        name, by_default = _choose(backend, self.validators.parse_device("device", device))
        if by_default and name == "cpu":
            return self._default_host_backend().name == "torch"  # where no compiler builds it
        return name == "torch"


_runtimes: PerTree[Runtime] = PerTree(Runtime)


def runtime_for(tree) -> Runtime:
    """The Runtime of a generated package (e.g. kv_canary.generated or kv_canary.load_generated(path))."""
    return _runtimes.get(tree)
