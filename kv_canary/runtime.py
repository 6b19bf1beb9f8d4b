"""Validation + backend dispatch for one generated layer (the default one or any other schema's).

Every launch validates its inputs with the layer's generated validators (host-side, from shapes
and dtypes only) and then hands them to a backend chosen by, in order: the `backend=` keyword,
the KV_CANARY_BACKEND environment variable, the tensors' device (CUDA tensors -> `cuda` when
CuPy sees a device, otherwise `torch`).

The public functions are generated per schema (generated/api.py: SGLang's exact keyword-only
signatures, plus the input-field keywords only where the schema declares such fields); they call
this Runtime, whose methods accept every keyword internally (an absent field mapping means {}).
"""
from __future__ import annotations

import functools
import importlib
import os
import threading

import torch

from .backends import KNOWN_BACKENDS, get_backend

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
    """The four launch functions of one generated layer (SGLang's keywords, plus `backend=`)."""

    def __init__(self, layer):
        self.layer = layer
        self.layout = layer.layout
        self.validators = importlib.import_module(layer.__name__ + ".validators")
        self.allocators = importlib.import_module(layer.__name__ + ".allocators")

    @property
    def api(self):
        """The layer's generated public API module (`<layer>.api`), with its per-schema signatures."""
        return importlib.import_module(self.layer.__name__ + ".api")

    def backend(self, name: str):
        return get_backend(name, self.layer)

    def launch_canary_write_kernel(self, *, context, plan, input_ids, positions, out_cache_loc,
                                   enable_write_input_assert, expected_input_tokens=None,
                                   expected_input_positions=None, extra_inputs=None, backend=None) -> None:
        extra = self.validators.validate_write(
            context=context, plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
            expected_input_positions=expected_input_positions, extra_inputs=extra_inputs)
        self.backend(choose_backend(backend, context.canary_buf.device)).write(
            context=context, plan=plan, input_ids=input_ids, positions=positions, out_cache_loc=out_cache_loc,
            enable_write_input_assert=enable_write_input_assert, expected_input_tokens=expected_input_tokens,
            expected_input_positions=expected_input_positions, extra_inputs=extra)

    def launch_canary_verify_kernel(self, *, context, plan, check_verify_expected_token,
                                    extra_slot_tables=None, backend=None) -> None:
        extra = self.validators.validate_verify(context=context, plan=plan,
                                                check_verify_expected_token=check_verify_expected_token,
                                                extra_slot_tables=extra_slot_tables)
        self.backend(choose_backend(backend, context.canary_buf.device)).verify(
            context=context, plan=plan, check_verify_expected_token=check_verify_expected_token,
            extra_slot_tables=extra)

    def launch_canary_plan_kernels(self, *, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens,
                                   extend_seq_lens, req_to_token, swa_window_size, full_to_swa_index_mapping,
                                   verify_capacity, req_to_verify_expected_tokens=None,
                                   req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0,
                                   extra_request_values=None, backend=None) -> None:
        kwargs = dict(verify_plan_out=verify_plan_out, write_plan_out=write_plan_out,
                      req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, extend_seq_lens=extend_seq_lens,
                      req_to_token=req_to_token, swa_window_size=swa_window_size,
                      full_to_swa_index_mapping=full_to_swa_index_mapping, verify_capacity=verify_capacity,
                      req_to_verify_expected_tokens=req_to_verify_expected_tokens,
                      req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
                      kv_token_id_vs_position_offset=kv_token_id_vs_position_offset)
        extra = self.validators.validate_plan(**kwargs, extra_request_values=extra_request_values)
        self.backend(choose_backend(backend, req_to_token.device)).plan(**kwargs, extra_request_values=extra)

    def scatter_req_token_ids(self, *, flat_in, offsets, req_pool_indices, pool_out, backend=None) -> None:
        self.validators.validate_scatter(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                                         pool_out=pool_out)
        self.backend(choose_backend(backend, pool_out.device)).scatter(
            flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices, pool_out=pool_out)

    # SGLang's reference names: the same launches, always on the torch reference.
    def launch_canary_write_kernel_torch_reference(self, **kwargs) -> None:
        self.launch_canary_write_kernel(**_no_backend("launch_canary_write_kernel", kwargs), backend="torch")

    def launch_canary_verify_kernel_torch_reference(self, **kwargs) -> None:
        self.launch_canary_verify_kernel(**_no_backend("launch_canary_verify_kernel", kwargs), backend="torch")

    def launch_canary_plan_kernels_torch_reference(self, **kwargs) -> None:
        self.launch_canary_plan_kernels(**_no_backend("launch_canary_plan_kernels", kwargs), backend="torch")

    def scatter_req_token_ids_torch_reference(self, **kwargs) -> None:
        self.scatter_req_token_ids(**_no_backend("scatter_req_token_ids", kwargs), backend="torch")


def _no_backend(launch: str, kwargs: dict) -> dict:
    """The *_torch_reference variants pin the backend; a caller's `backend=` is a mistake, said plainly."""
    if "backend" in kwargs:
        raise TypeError(f"kv-canary: {launch}_torch_reference always runs the torch reference and takes no "
                        f"backend= keyword, got backend={kwargs['backend']!r}; call {launch}(backend=...) instead")
    return kwargs


_runtimes: dict = {}
_lock = threading.Lock()


def runtime_for(layer) -> Runtime:
    """The Runtime of a generated package (e.g. kv_canary.generated or kv_canary.load_generated(path))."""
    with _lock:
        rt = _runtimes.get(layer.__name__)
        if rt is None or rt.layer is not layer:
            rt = _runtimes[layer.__name__] = Runtime(layer)
        return rt
