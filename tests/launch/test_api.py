"""The public API: SGLang names and signatures per schema, backend dispatch, runtime_for another schema."""
from __future__ import annotations

import importlib
import inspect
import random
import sys
import types

import pytest
import torch
from support import scenarios
from support.oracle import Oracle
from support.trees import EXAMPLE_SCHEMAS, ROOT, generate_tree

import kv_canary
import kv_canary.backends as backends
import kv_canary.launch.runtime as runtime_module
from kv_canary.backends import Prepared

# SGLang's keyword-only parameters, in SGLang's order.
SGLANG_PARAMS = {
    "launch_canary_write_kernel": ("context", "plan", "input_ids", "positions", "out_cache_loc",
                                   "enable_write_input_assert", "expected_input_tokens", "expected_input_positions"),
    "launch_canary_verify_kernel": ("context", "plan", "check_verify_expected_token"),
    "launch_canary_plan_kernels": ("verify_plan_out", "write_plan_out", "req_pool_indices", "prefix_lens",
                                   "extend_seq_lens", "req_to_token", "swa_window_size", "full_to_swa_index_mapping",
                                   "verify_capacity", "req_to_verify_expected_tokens",
                                   "req_to_verify_expected_tokens_valid_lens", "kv_token_id_vs_position_offset"),
    "scatter_req_token_ids": ("flat_in", "offsets", "req_pool_indices", "pool_out"),
}
# docs/semantics.md §8: the keyword each launch gains when the schema declares the matching input fields.
FIELD_KEYWORD = {"launch_canary_write_kernel": "extra_inputs", "launch_canary_verify_kernel": "extra_slot_tables",
                 "launch_canary_plan_kernels": "extra_request_values"}
KIND = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
        "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}
MAKE = {"write": scenarios.make_write_case, "verify": scenarios.make_verify_case, "plan": scenarios.make_plan_case,
        "scatter": scenarios.make_scatter_case}
OWNER_EPOCH = ROOT / "kv_canary" / "schemas" / "owner_epoch.yaml"


def api_of(tree):
    return importlib.import_module(tree.__name__ + ".api")


def declared_keywords(tree) -> set:
    """The field keywords this schema's launches must take, from its layout's input fields."""
    fields = tree.layout.INPUT_FIELDS
    out = set()
    if fields:
        out.add("extra_inputs")
    if any(f.verify_expected == "per_request" for f in fields):
        out.add("extra_request_values")
    if any(f.verify_expected == "per_slot" for f in fields):
        out.add("extra_slot_tables")
    return out


def for_api(func, case: dict) -> dict:
    """A scenario case (Runtime keywords) cut to `func`'s signature; only empty field mappings may go."""
    params = inspect.signature(func).parameters
    dropped = {k: v for k, v in case.items() if k not in params}
    assert all(k.startswith("extra_") and not v for k, v in dropped.items()), dropped
    return {k: v for k, v in case.items() if k in params}


def test_sglang_names_are_exported():
    for name in [*SGLANG_PARAMS, *(n + "_torch_reference" for n in SGLANG_PARAMS),
                 "RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "runtime_for"]:
        assert callable(getattr(kv_canary, name)), name
    assert kv_canary.launch_canary_write_kernel is kv_canary.generated.api.launch_canary_write_kernel


# -- signatures (docs/semantics.md §8: field keywords only where the schema declares fields) -----------------
def test_signatures_follow_the_schema(any_tree):
    api = api_of(any_tree)
    declared = declared_keywords(any_tree)
    assert any_tree.api is api and kv_canary.runtime_for(any_tree).api is api
    for name, sglang in SGLANG_PARAMS.items():
        extra = (FIELD_KEYWORD[name],) if FIELD_KEYWORD.get(name) in declared else ()
        for variant, tail in ((name, ("backend",)), (name + "_torch_reference", ())):
            params = inspect.signature(getattr(api, variant)).parameters
            assert tuple(params) == sglang + extra + tail, variant
            assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values()), variant
            for keyword in extra:  # required: a schema field without its values is a mistake
                assert params[keyword].default is inspect.Parameter.empty, (variant, keyword)
            if tail:
                assert params["backend"].default is None


def test_default_schema_signatures_have_no_field_keywords(default_tree):
    assert declared_keywords(default_tree) == set()
    for name in [*SGLANG_PARAMS, *(n + "_torch_reference" for n in SGLANG_PARAMS)]:
        params = inspect.signature(getattr(kv_canary, name)).parameters
        assert not [p for p in params if p.startswith("extra_")], (name, list(params))


def test_owner_epoch_signatures_have_every_field_keyword():
    api = api_of(generate_tree(OWNER_EPOCH))
    assert "extra_inputs" in inspect.signature(api.launch_canary_write_kernel).parameters
    assert "extra_request_values" in inspect.signature(api.launch_canary_plan_kernels).parameters
    assert "extra_slot_tables" in inspect.signature(api.launch_canary_verify_kernel).parameters
    assert "extra_" not in str(inspect.signature(api.scatter_req_token_ids))
    case = scenarios.make_write_case(random.Random(6), generate_tree(OWNER_EPOCH))
    case.pop("extra_inputs")
    with pytest.raises(TypeError, match="extra_inputs"):
        api.launch_canary_write_kernel(**case)


def test_reference_variants_reject_backend(default_tree):
    case = scenarios.make_verify_case(random.Random(4), default_tree)
    with pytest.raises(TypeError) as err:
        func = kv_canary.launch_canary_verify_kernel_torch_reference
        func(**for_api(func, case), backend="emulated")
    assert "backend" in str(err.value) and "multiple values" not in str(err.value)


# -- dispatch ---------------------------------------------------------------------------------------------
class _Recorder:
    checks_index_values = None  # records launches; makes no index-value checks
    """Stands in for a backend: records (backend name, operation) instead of running anything."""

    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def prepare(self, op: str, args: dict, **_):
        return Prepared(lambda: self.calls.append((self.name, op.name)), args)


@pytest.fixture
def dispatched(monkeypatch):
    calls: list = []
    monkeypatch.setattr(runtime_module, "get_backend", lambda name, tree: _Recorder(name, calls))
    monkeypatch.setattr(kv_canary.runtime_for(kv_canary.generated), "chosen", {})  # the choices made before
    monkeypatch.delenv(runtime_module.ENV_BACKEND, raising=False)
    cases = {kind: MAKE[kind](random.Random(10 + i), kv_canary.generated, n_reqs=3) for i, kind in enumerate(KIND)}

    def run(*, reference: bool = False, **backend) -> list:
        calls.clear()
        for kind, case in cases.items():
            func = getattr(kv_canary, KIND[kind] + ("_torch_reference" if reference else ""))
            func(**for_api(func, case), **backend)
        return list(calls)

    yield run, monkeypatch


def test_dispatch_picks_the_backend(dispatched):
    run, monkeypatch = dispatched
    ops = ["write", "verify", "plan", "scatter"]
    assert run() == [("cpu", op) for op in ops]                             # CPU tensors: the native kernels
    assert run(backend="emulated") == [("emulated", op) for op in ops]
    monkeypatch.setenv(runtime_module.ENV_BACKEND, "emulated")
    assert run() == [("emulated", op) for op in ops]                        # the environment variable
    assert run(backend="torch") == [("torch", op) for op in ops]            # the keyword wins over it
    assert run(reference=True) == [("torch", op) for op in ops]             # references: always torch
    monkeypatch.setenv(runtime_module.ENV_BACKEND, "torch")
    assert run(backend="emulated") == [("emulated", op) for op in ops]


def test_forcing_cuda_with_cpu_tensors_is_an_error(monkeypatch):
    case = scenarios.make_verify_case(random.Random(1), kv_canary.generated)
    case = for_api(kv_canary.launch_canary_verify_kernel, case)
    with pytest.raises(ValueError, match="^kv-canary: backend 'cuda' needs CUDA tensors, got tensors on cpu$"):
        kv_canary.launch_canary_verify_kernel(**case, backend="cuda")
    monkeypatch.setenv("KV_CANARY_BACKEND", "cuda")
    with pytest.raises(ValueError, match="needs CUDA tensors"):
        kv_canary.launch_canary_verify_kernel(**case)


def test_unknown_backend_names(monkeypatch):
    case = scenarios.make_scatter_case(random.Random(2), kv_canary.generated)
    with pytest.raises(ValueError, match=r"^kv-canary: backend='tpu' is not a backend; expected one of torch, cpu, cuda, emulated$"):
        kv_canary.scatter_req_token_ids(**case, backend="tpu")
    monkeypatch.setenv("KV_CANARY_BACKEND", "tpu")
    with pytest.raises(ValueError, match=r"^kv-canary: KV_CANARY_BACKEND='tpu' is not a backend"):
        kv_canary.scatter_req_token_ids(**case)
    monkeypatch.setenv("KV_CANARY_BACKEND", "torch")
    kv_canary.scatter_req_token_ids(**case)


def test_validation_runs_before_any_backend():
    """A bad input is reported even when the chosen backend does not exist."""
    case = scenarios.make_write_case(random.Random(3), kv_canary.generated)
    case = for_api(kv_canary.launch_canary_write_kernel, case)
    case["positions"] = case["positions"].to(torch.int32)
    with pytest.raises(TypeError, match="positions must have dtype torch.int64"):
        kv_canary.launch_canary_write_kernel(**case, backend="cuda")


def test_unavailable_backends_give_a_clear_error(monkeypatch):
    fake = types.ModuleType("kv_canary.backends.fake")

    def create(tree):
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


# -- another schema's tree -----------------------------------------------------------------------------
@pytest.mark.parametrize("schema", EXAMPLE_SCHEMAS, ids=lambda p: p.stem)
def test_runtime_for_another_schema(schema):
    """Its generated API and its Runtime both end in the state the scalar oracle derives."""
    tree = generate_tree(schema)
    rt = scenarios.runtime_for(tree)
    assert rt.runtime is kv_canary.runtime_for(tree) and rt.tree is tree
    api = api_of(tree)
    for kind in KIND:
        for seed in range(3):
            case = MAKE[kind](random.Random(100 + seed), tree, n_reqs=4)
            via_api, via_rt, expected = (scenarios.clone_case(case) for _ in range(3))
            func = getattr(api, KIND[kind])
            func(**for_api(func, via_api))
            getattr(rt, KIND[kind])(**via_rt)
            getattr(Oracle(tree), kind)(**expected)
            scenarios.compare_state(via_api, expected)
            scenarios.compare_state(via_rt, expected)
            if kind in ("write", "verify"):  # the launch really ran: the counter moved
                before = int(case["context"].kernel_run_counter[0])
                assert int(via_api["context"].kernel_run_counter[0]) == before + 1
            elif kind == "plan":
                assert int(via_api["write_plan_out"].write_num_valid_reqs[0]) == 4
    # The Runtime (what the manager calls) validates field mappings itself.
    if tree.layout.INPUT_FIELDS:
        case = scenarios.make_write_case(random.Random(6), tree)
        case.pop("extra_inputs")
        with pytest.raises(ValueError, match="extra_inputs must have exactly the keys"):
            rt.launch_canary_write_kernel(**case)
