"""Validation + backend dispatch for one generated layer (the default one or any other schema's).

A generated layer's public functions (generated/api.py, rendered from the launch table in
codegen/launches.py: SGLang's exact keyword-only signatures plus `backend=`) all call
`Runtime.launch(operation, device_of, backend, **arguments)`: the layer's validators check the
arguments (host-side, from shapes and dtypes only) and return the backend operation's keywords,
then the backend chosen by, in order, the `backend=` keyword, the KV_CANARY_BACKEND environment
variable and the tensors' device (CUDA tensors -> `cuda` when CuPy sees a device, otherwise
`torch`) runs it. The layer receives its runtime from kv_canary.load_generated (the generated
package imports nothing from kv_canary).

`runtime_for(layer).launch_canary_write_kernel(...)` (any public launch name) takes every keyword of
every schema (an absent input-field mapping means {}): what the manager and the tests use.
SGLang's `use_torch_reference(device)` is answered by this same choice, so it composes with
`backend=` and KV_CANARY_BACKEND exactly as the launches do.

Validation, backend choice and argument binding run once per set of inputs and are reused while the
inputs keep their signature (kv_canary/launch_cache.py, signed natively where kv_canary/native is
built): a repeated launch costs less than one bare kernel launch on the host, and a changed input
still meets every check before its launch.
"""
from __future__ import annotations

import functools
import os
import threading

import torch

from .allocation import allocators_for
from .backends import KNOWN_BACKENDS, get_backend
from .launch_cache import LaunchPath
from .signature import shape_signer_for, signer
from .validation_cache import CachedValidators

ENV_BACKEND = "KV_CANARY_BACKEND"


@functools.lru_cache(maxsize=1)
def cupy_sees_a_device() -> bool:
    try:
        import cupy
        return cupy.cuda.runtime.getDeviceCount() > 0
    except Exception:  # no CuPy, no driver or no device: the torch reference runs instead
        return False


def choose_backend(backend: str | None, device: torch.device) -> str:
    name = backend if backend is not None else (os.environ.get(ENV_BACKEND) or None)
    if name is None:
        return "cuda" if device.type == "cuda" and cupy_sees_a_device() else "torch"
    if name not in KNOWN_BACKENDS:
        source = "backend=" if backend is not None else f"{ENV_BACKEND}="
        raise ValueError(f"kv-canary: {source}{name!r} is not a backend; expected one of {', '.join(KNOWN_BACKENDS)}")
    if name == "cuda" and device.type != "cuda":
        raise ValueError(f"kv-canary: backend 'cuda' needs CUDA tensors, got tensors on {device}")
    return name


class Runtime:
    """The launches, validators and allocators of one generated layer."""

    def __init__(self, layer, *, sign=None):
        self.layer = layer
        self.layout = layer.layout
        # The signer every cache key of this runtime comes from: the native one where it is built
        # (kv_canary/native), else python_signature; tests pass python_signature to cover both.
        self.sign = sign if sign is not None else signer()
        self.sign_shape = shape_signer_for(self.sign)  # None: full signatures only (launch_cache.py)
        self.validators = CachedValidators(layer.layout, sign=self.sign)
        self.allocators = allocators_for(layer.layout, self.validators)
        self._paths: dict = {}  # (operation, device_of) -> LaunchPath
        self._named: dict = {}  # public launch name -> its LaunchPath (bind)

    @property
    def api(self):
        """The layer's generated public API module (`<layer>.api`), with its per-schema signatures."""
        return self.layer.api

    def backend(self, name: str):
        return get_backend(name, self.layer)

    def launch(self, operation: str, device_of: str, backend, **arguments) -> None:
        """Validate `arguments` for `operation`, then run it on the chosen backend (validation and
        binding reused while the arguments keep their signature)."""
        path = self._paths.get((operation, device_of))
        if path is None:
            path = self._path(operation, device_of)
        entry, args = path.bind(backend, arguments)
        entry.prepared.run(args)

    def _path(self, operation: str, device_of: str) -> LaunchPath:
        path = self._paths[(operation, device_of)] = LaunchPath(self, operation, device_of, choose_backend=choose_backend,
                                                                env_backend=ENV_BACKEND)
        return path

    def forget(self) -> None:
        """Drop every cached launch and remembered check (after swapping backends, say): the next
        launches run their whole host path again."""
        for path in self._paths.values():
            path.forget()
        self.validators.forget()

    def bind(self, name: str, **arguments):
        """Validate and bind the public launch `name` without launching it; returns a function that
        launches it. What every launch does before its kernel call (the host cost that
        bench/bench_host.py measures); the returned function does not look at its inputs again."""
        path = self._named.get(name)
        if path is None:
            launches = self.layer.api.LAUNCHES
            if name not in launches:
                raise ValueError(f"kv-canary: {self.layer.__name__} has no launch named {name!r}; "
                                 f"launches are {', '.join(launches)}")
            operation, device_of = launches[name]
            path = self._named[name] = self._paths.get((operation, device_of)) or self._path(operation, device_of)
        entry, args = path.bind(arguments.pop("backend", None), arguments)
        return functools.partial(entry.prepared.run, args)

    def compute_slot_hash(self, buf_i64, source_slot_idx) -> int:
        """SGLang's compute_slot_hash: the link of one slot (u64), HEAD for a negative slot."""
        args = self.validators.validate_slot_hash(buf_i64=buf_i64, source_slot_idx=source_slot_idx)
        return self.layer.reference.compute_slot_hash(**args)

    def use_torch_reference(self, device, *, backend=None) -> bool:
        """SGLang's predicate, answered by the launches' own backend choice (choose_backend)."""
        return choose_backend(backend, self.validators.parse_device("device", device)) == "torch"

    def __getattr__(self, name: str):
        """Every public launch by name, taking every keyword of every schema plus `backend=`."""
        if name.startswith("__") or "layer" not in self.__dict__:  # dunders, and lookups before __init__ ran
            raise AttributeError(name)
        launches = self.layer.api.LAUNCHES
        found = None
        if name in launches:
            operation, device_of = launches[name]
            found = functools.partial(self._launch_any, operation, device_of)
        launch = name.removesuffix("_torch_reference")
        if launch != name and launch in launches and name in self.layer.api.__all__:
            operation, device_of = launches[launch]
            found = functools.partial(self._launch_any, operation, device_of, reference_of=launch)
        if found is not None:
            self.__dict__[name] = found  # found once: later calls skip __getattr__ (a launch's host path)
            return found
        raise AttributeError(f"kv-canary: the runtime of {self.layer.__name__} has no attribute {name!r}")

    def _launch_any(self, operation: str, device_of: str, reference_of: str = "", **arguments) -> None:
        backend = arguments.pop("backend", None)
        if reference_of:  # SGLang's reference names pin the backend; a backend= there is a mistake, said plainly
            if backend is not None:
                raise TypeError(f"kv-canary: {reference_of}_torch_reference always runs the torch reference and takes "
                                f"no backend= keyword, got backend={backend!r}; call {reference_of}(backend=...) "
                                f"instead")
            backend = "torch"
        self.launch(operation, device_of, backend, **arguments)


_runtimes: dict = {}
_lock = threading.Lock()


def runtime_for(layer) -> Runtime:
    """The Runtime of a generated package (e.g. kv_canary.generated or kv_canary.load_generated(path))."""
    with _lock:
        rt = _runtimes.get(layer.__name__)
        if rt is None or rt.layer is not layer:
            rt = _runtimes[layer.__name__] = Runtime(layer)
        return rt
