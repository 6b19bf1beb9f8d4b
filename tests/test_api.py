"""The public API: SGLang names, backend dispatch, runtime_for another schema."""
from __future__ import annotations

import random
import sys
import types

import pytest
import scenarios
import torch
from conftest import EXAMPLE_SCHEMAS, generate_layer

import kv_canary
import kv_canary.backends as backends
from kv_canary.runtime import choose_backend

NAMES = ["launch_canary_write_kernel", "launch_canary_verify_kernel", "launch_canary_plan_kernels",
         "scatter_req_token_ids", "launch_canary_write_kernel_torch_reference",
         "launch_canary_verify_kernel_torch_reference", "launch_canary_plan_kernels_torch_reference"]


def test_sglang_names_are_exported():
    for name in NAMES + ["RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "runtime_for"]:
        assert callable(getattr(kv_canary, name)), name


def test_cpu_tensors_go_to_torch(monkeypatch):
    monkeypatch.delenv("KV_CANARY_BACKEND", raising=False)
    assert choose_backend(None, torch.device("cpu")) == "torch"
    assert choose_backend("emulated", torch.device("cpu")) == "emulated"


def test_forcing_cuda_with_cpu_tensors_is_an_error(monkeypatch):
    case = scenarios.make_verify_case(random.Random(1), kv_canary.generated)
    with pytest.raises(ValueError, match="^kv-canary: backend 'cuda' needs CUDA tensors, got tensors on cpu$"):
        kv_canary.launch_canary_verify_kernel(**case, backend="cuda")
    monkeypatch.setenv("KV_CANARY_BACKEND", "cuda")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kv_canary.launch_canary_verify_kernel(**case)


def test_unknown_backend_names(monkeypatch):
    case = scenarios.make_scatter_case(random.Random(2), kv_canary.generated)
    with pytest.raises(ValueError, match=r"^kv-canary: backend='tpu' is not a backend; expected one of torch, cuda, emulated$"):
        kv_canary.scatter_req_token_ids(**case, backend="tpu")
    monkeypatch.setenv("KV_CANARY_BACKEND", "tpu")
    with pytest.raises(ValueError, match=r"^kv-canary: KV_CANARY_BACKEND='tpu' is not a backend"):
        kv_canary.scatter_req_token_ids(**case)
    monkeypatch.setenv("KV_CANARY_BACKEND", "torch")
    kv_canary.scatter_req_token_ids(**case)


def test_validation_runs_before_any_backend(monkeypatch):
    """A bad input is reported even when the chosen backend does not exist."""
    case = scenarios.make_write_case(random.Random(3), kv_canary.generated)
    case["positions"] = case["positions"].to(torch.int32)
    with pytest.raises(TypeError, match="positions must have dtype torch.int64"):
        kv_canary.launch_canary_write_kernel(**case, backend="cuda")


def test_unavailable_backends_give_a_clear_error(monkeypatch):
    fake = types.ModuleType("kv_canary.backends.fake")

    def create(layer):
        raise backends.BackendUnavailable("no accelerator here")

    fake.create = create
    monkeypatch.setattr(backends, "KNOWN_BACKENDS", backends.KNOWN_BACKENDS + ("fake", "missing"))
    monkeypatch.setitem(sys.modules, "kv_canary.backends.fake", fake)
    with pytest.raises(ValueError, match=r"^kv-canary: backend 'fake' is not available: no accelerator here$"):
        backends.get_backend("fake", kv_canary.generated)
    with pytest.raises(ValueError, match=r"^kv-canary: backend 'missing' is not available: module "
                                         r"kv_canary.backends.missing is not installed$"):
        backends.get_backend("missing", kv_canary.generated)
    assert backends.get_backend("torch", kv_canary.generated) is backends.get_backend("torch", kv_canary.generated)


def test_reference_variants_match_dispatch():
    case = scenarios.make_verify_case(random.Random(4), kv_canary.generated)
    a, b = scenarios.clone_case(case), scenarios.clone_case(case)
    kv_canary.launch_canary_verify_kernel(**a)
    kv_canary.launch_canary_verify_kernel_torch_reference(**b)
    scenarios.compare_state(a, b)


@pytest.mark.parametrize("schema", EXAMPLE_SCHEMAS, ids=lambda p: p.stem)
def test_runtime_for_another_schema(schema):
    layer = generate_layer(schema)
    rt = kv_canary.runtime_for(layer)
    assert rt is kv_canary.runtime_for(layer)
    for make, name in ((scenarios.make_write_case, "launch_canary_write_kernel"),
                       (scenarios.make_verify_case, "launch_canary_verify_kernel"),
                       (scenarios.make_plan_case, "launch_canary_plan_kernels")):
        case = make(random.Random(5), layer)
        getattr(rt, name)(**case)
    # A schema with input fields requires their per-token values.
    if layer.layout.INPUT_FIELDS:
        case = scenarios.make_write_case(random.Random(6), layer)
        case.pop("extra_inputs")
        with pytest.raises(ValueError, match="extra_inputs must have exactly the keys"):
            rt.launch_canary_write_kernel(**case)
