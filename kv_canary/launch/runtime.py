"""Validation + backend dispatch for one generated layer (the default one or any other schema's).

A generated layer's public functions (generated/api.py, rendered from the launch table in
codegen/launches.py: SGLang's exact keyword-only signatures plus `backend=`) all call
`Runtime.launch(operation, device_of, backend, **arguments)`, which does, at every call:

1. `Validators.check(operation, arguments)` (kv_canary/launch/validation.py): every check, from shapes,
   dtypes, storages and Python values only; it returns the backend operation's keywords;
2. the backend: the `backend=` keyword, else the KV_CANARY_BACKEND environment variable, else the
   tensors' device (CUDA tensors -> `cuda` when CuPy sees a device, otherwise `torch`; CPU tensors ->
   `cpu`, the kernels compiled for the host, or, where that backend cannot be built (no compiler, a
   failed build), the torch reference, after one warning naming the cause);
3. `backend.prepare(operation, args).run()` (kv_canary/backends/).

`Runtime.bind(name, **arguments)` stops before the run: a `PreparedLaunch` that launches the same
kernels again and again without looking at its arguments (what an engine with fixed buffers wants,
and what a CUDA graph captures); `rebind(**changed)` names the arguments that changed and checks the
whole launch again. The runtime of a layer also has each public launch as a method (taking every
keyword of every schema; an absent input-field mapping means {}), what the manager and tests use.
"""
from __future__ import annotations

import functools
import os
import warnings

import torch

from ..backends import KNOWN_BACKENDS, Prepared, get_backend
from ..layer.memo import PerLayer
from .allocation import allocators_for
from .validation import Validators

ENV_BACKEND = "KV_CANARY_BACKEND"


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


@functools.cache
def _device_getter(path: str):
    """args -> the device of the argument at `path` ("req_to_token", "context.canary_buf")."""
    head, _, attr = path.partition(".")
    if attr:
        return lambda args: getattr(args[head], attr).device
    return lambda args: args[head].device


class PreparedLaunch:
    """One public launch validated and bound (Runtime.bind). Calling it (or `run()`) launches the
    bound kernels; it never looks at its arguments again, so it is for buffers whose shapes and
    storage stay as they were (refilled in place): a tensor moved after binding (`set_`, a resized
    storage) is not seen, and must be bound again. `rebind(**changed)`: the same launch with the
    named arguments replaced, validated and bound again as a whole (every free-function launch is
    validated as a whole too, a context's tensors included, so there a moved tensor is refused)."""

    def __init__(self, runtime: "Runtime", name: str, backend, arguments: dict):
        operation, device_of = runtime.launches[name]
        self.runtime, self.name, self.backend, self.arguments = runtime, name, backend, arguments
        self.prepared: Prepared = runtime.prepare(operation, device_of, backend, arguments)
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
    """The launches, validators and allocators of one generated layer."""

    def __init__(self, layer):
        self.layer = layer
        self.api = layer.api  # the layer's generated public API module, with its per-schema signatures
        self.validators = Validators(layer.layout)
        self.allocators = allocators_for(layer.layout, self.validators)
        self.launches = layer.api.LAUNCHES  # public launch name -> (operation, device_of)
        self._cpu_unavailable = False  # the cpu backend could not be built: CPU tensors get the torch reference

    def backend(self, name: str):
        return get_backend(name, self.layer)

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

    def prepare(self, operation: str, device_of: str, backend, arguments: dict) -> Prepared:
        """Validate `arguments` for `operation`, choose the backend, bind: everything before the kernel call."""
        read = [] if operation in self.validators.real_kv_operations else None  # what validation reads, binding takes
        args = self.validators.check(operation, arguments, read)
        device = _device_getter(device_of)(args)
        return self.backend_for(backend, device).prepare(operation, args, read=read)

    def launch(self, operation: str, device_of: str, backend, **arguments) -> None:
        """Validate `arguments` for `operation`, then run it on the chosen backend."""
        self.prepare(operation, device_of, backend, arguments).run()

    def bind(self, name: str, **arguments) -> PreparedLaunch:
        """The public launch `name` validated and bound, not launched (PreparedLaunch)."""
        if name not in self.launches:
            raise ValueError(f"kv-canary: {self.layer.__name__} has no launch named {name!r}; "
                             f"launches are {', '.join(self.launches)}")
        return PreparedLaunch(self, name, arguments.pop("backend", None), arguments)

    def compute_slot_hash(self, buf_i64, source_slot_idx) -> int:
        """SGLang's compute_slot_hash: the link of one slot (u64), HEAD for a negative slot."""
        args = self.validators.validate_slot_hash(buf_i64=buf_i64, source_slot_idx=source_slot_idx)
        return self.layer.reference.compute_slot_hash(**args)

    def use_torch_reference(self, device, *, backend=None) -> bool:
        """SGLang's predicate, answered by the launches' own backend choice (backend_for)."""
        name, by_default = _choose(backend, self.validators.parse_device("device", device))
        if by_default and name == "cpu":
            return self._default_host_backend().name == "torch"  # where no compiler builds it
        return name == "torch"

    # -- the public launches by name (every keyword of every schema, plus backend=) ----------------
    def _public(self, name: str, arguments: dict, *, reference: bool = False) -> None:
        operation, device_of = self.launches[name]
        backend = arguments.pop("backend", None)
        if reference:  # SGLang's reference names pin the backend; a backend= there is a mistake, said plainly
            if backend is not None:
                raise TypeError(f"kv-canary: {name}_torch_reference always runs the torch reference and takes "
                                f"no backend= keyword, got backend={backend!r}; call {name}(backend=...) instead")
            backend = "torch"
        self.prepare(operation, device_of, backend, arguments).run()

    def launch_canary_write_kernel(self, **arguments) -> None:
        self._public("launch_canary_write_kernel", arguments)

    def launch_canary_verify_kernel(self, **arguments) -> None:
        self._public("launch_canary_verify_kernel", arguments)

    def launch_canary_plan_kernels(self, **arguments) -> None:
        self._public("launch_canary_plan_kernels", arguments)

    def scatter_req_token_ids(self, **arguments) -> None:
        self._public("scatter_req_token_ids", arguments)

    def launch_plan_offsets_kernel(self, **arguments) -> None:
        self._public("launch_plan_offsets_kernel", arguments)

    def launch_plan_entries_kernel(self, **arguments) -> None:
        self._public("launch_plan_entries_kernel", arguments)

    def launch_scatter_req_token_ids_kernel(self, **arguments) -> None:
        self._public("launch_scatter_req_token_ids_kernel", arguments)

    def launch_canary_write_kernel_torch_reference(self, **arguments) -> None:
        self._public("launch_canary_write_kernel", arguments, reference=True)

    def launch_canary_verify_kernel_torch_reference(self, **arguments) -> None:
        self._public("launch_canary_verify_kernel", arguments, reference=True)

    def launch_canary_plan_kernels_torch_reference(self, **arguments) -> None:
        self._public("launch_canary_plan_kernels", arguments, reference=True)

    def scatter_req_token_ids_torch_reference(self, **arguments) -> None:
        self._public("scatter_req_token_ids", arguments, reference=True)


_runtimes: PerLayer[Runtime] = PerLayer(Runtime)


def runtime_for(layer) -> Runtime:
    """The Runtime of a generated package (e.g. kv_canary.generated or kv_canary.load_generated(path))."""
    return _runtimes.get(layer)
