"""request_input fields (kv_canary/schemas/isolation.yaml): the namespace helpers, and CanaryManager's
request_inputs: refused at attach when missing, each value checked before any launch, asked once per
request, written as the writer's value and verified against every reader's own."""
from __future__ import annotations

import hashlib
import subprocess
import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine
from kv_canary.engine import request_inputs as ri
from kv_canary.engine.manager import CanaryManager

torch.set_num_threads(1)
FIELD = ri.NAMESPACE_FIELD
SIM = replace(faults.BASE, tenants=2)


@pytest.fixture(scope="module")
def isolation():
    return faults.example_tree("isolation")


# -- namespace_of / vllm_request_namespace ------------------------------------------------------------
def test_namespace_of_is_an_int64_that_tells_parts_apart():
    values = [ri.namespace_of(*p) for p in [("a",), ("b",), ("ab", "c"), ("a", "bc"), (None,), (None, "a"),
                                            ("a", None), (1,), ("1",), (b"1",), (("a", "b"),), ("a", "b"), (True,)]]
    assert len(set(values)) == len(values)
    assert all(isinstance(v, int) and -(1 << 63) <= v < (1 << 63) for v in values)
    assert ri.namespace_of() == ri.DEFAULT_NAMESPACE == 0
    assert ri.namespace_of("tenant", 7) == ri.namespace_of("tenant", 7)


def test_namespace_of_is_stable_across_processes():
    """Not Python's salted hash(): another interpreter (another PYTHONHASHSEED) gets the same value."""
    code = "from kv_canary.engine.request_inputs import namespace_of; print(namespace_of('salt', ('lora', 3, 'x')))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONHASHSEED": "123", **{k: v for k, v in __import__("os").environ.items()
                                                           if k != "PYTHONHASHSEED"}})
    assert int(out.stdout) == ri.namespace_of("salt", ("lora", 3, "x"))


@pytest.mark.parametrize("digest", [b"\xff" * 8, b"\x00" * 8])
def test_namespace_of_never_lands_on_unknown_or_the_default(monkeypatch, digest):
    class Fixed:
        def __init__(self, *args, **kwargs):
            pass

        def digest(self):
            return digest
    monkeypatch.setattr(hashlib, "blake2b", Fixed)
    value = ri.namespace_of("x")
    assert value not in (-1, 0) and value == int.from_bytes(digest, "little", signed=True) ^ 0x5A5A5A5A5A5A5A5A


def test_namespace_of_refuses_other_types():
    with pytest.raises(ValueError, match=r"namespace_of parts must be None, bool, int, str, bytes or tuples/lists "
                                         r"of them, got float at parts\[1\]\[0\]"):
        ri.namespace_of("a", (1.5,))


def test_vllm_request_namespace_reads_adapter_salt_and_media_by_duck_typing():
    lora = lambda i, name: SimpleNamespace(lora_int_id=i, lora_name=name)  # noqa: E731
    plain = SimpleNamespace()
    assert ri.vllm_request_namespace(plain) == ri.vllm_request_namespace(
        SimpleNamespace(lora_request=None, cache_salt=None)) == ri.DEFAULT_NAMESPACE
    a, b = SimpleNamespace(cache_salt="a"), SimpleNamespace(cache_salt="b")
    assert len({ri.vllm_request_namespace(r) for r in (plain, a, b)}) == 3
    x1, x2, y1 = (SimpleNamespace(lora_request=lora(i, n)) for i, n in ((1, "x"), (2, "x"), (1, "y")))
    assert len({ri.vllm_request_namespace(r) for r in (plain, x1, x2, y1)}) == 4
    # The salt and the adapter are different parts: a salt "x" is not adapter "x".
    assert ri.vllm_request_namespace(SimpleNamespace(cache_salt="x")) != ri.vllm_request_namespace(x1)
    # Media only when asked for (a request-wide hash would flag correct text-prefix sharing).
    img1 = SimpleNamespace(cache_salt="a", mm_features=[SimpleNamespace(identifier="h1")])
    img2 = SimpleNamespace(cache_salt="a", mm_hashes=["h2"])
    assert ri.vllm_request_namespace(img1) == ri.vllm_request_namespace(img2) == ri.vllm_request_namespace(a)
    on = [ri.vllm_request_namespace(r, multimodal=True) for r in (img1, img2, a)]
    assert len(set(on)) == 3
    assert on[0] == ri.vllm_request_namespace(SimpleNamespace(cache_salt="a", mm_hashes=["h1"]), multimodal=True)


# -- the manager ------------------------------------------------------------------------------------
def test_a_schema_with_a_request_input_field_needs_the_function_at_attach(isolation):
    m = CanaryManager(tree=isolation, mode="log", sweep_interval=0)
    with pytest.raises(ValueError, match=r"the schema's request_input field\(s\) cache_namespace need their "
                                         r"per-request values: pass request_inputs=fn\(request\)"):
        Engine(SIM, canary=m)
    with pytest.raises(ValueError, match=r"request_inputs must be a function request -> \{field: int\}, got 3"):
        Engine(SIM, canary=CanaryManager(tree=isolation, request_inputs=3))


@pytest.mark.parametrize("returned, message", [
    ([1], r"request_inputs\(request rid=1\) must return a mapping of the schema's request_input fields "
          r"\(cache_namespace\) to int64 values, got \[1\]"),
    ({"namespace": 1}, r"request_inputs\(request rid=1\) gave no value for the schema's request_input field "
                       r"'cache_namespace' \(got keys: 'namespace'\)"),
    ({FIELD: 1 << 63}, r"request_inputs\(request rid=1\)\['cache_namespace'\] must be an int in the int64 range "
                       r"\[-9223372036854775808, 9223372036854775807\], got 9223372036854775808"),
    ({FIELD: True}, r"must be an int in the int64 range .*, got True"),
    ({FIELD: "7"}, r"must be an int in the int64 range .*, got '7'"),
    ({FIELD: -1}, r"\['cache_namespace'\] must not be -1 \(UNKNOWN: it would turn the check off\)"),
])
def test_each_value_is_checked_before_any_launch(isolation, returned, message):
    m = CanaryManager(tree=isolation, mode="log", sweep_interval=0, request_inputs=lambda r: returned)
    engine = Engine(SIM, canary=m)
    with pytest.raises(ValueError, match=message):
        engine.step()
    assert m.kernel_runs == 0


def test_the_function_is_asked_once_per_request_and_the_default_schema_never_asks(isolation):
    asked = []

    def supply(request):
        asked.append(request.rid)
        return {FIELD: ri.vllm_request_namespace(request), "other": 5}  # extra keys are ignored
    engine = Engine(SIM, canary=CanaryManager(tree=isolation, mode="log", request_inputs=supply))
    engine.run(40)
    assert len(asked) == len(set(asked)) >= 5 and engine.canary.stats.total == 0
    asked.clear()
    Engine(SIM, canary=CanaryManager(mode="log", request_inputs=supply)).run(10)
    assert asked == []


def test_a_new_engine_asks_again_for_rows_and_ids_it_reuses(isolation):
    """A manager attached to one engine after another (transformers: one per run) whose request ids
    start over: the values of the first engine's requests are not reused for the second's."""
    salt = {"now": "a"}
    m = CanaryManager(tree=isolation, mode="log", request_inputs=lambda r: {FIELD: ri.namespace_of(salt["now"])})
    Engine(SIM, canary=m).run(5)
    salt["now"] = "b"
    second = Engine(SIM, canary=m)
    second.run(5)
    word = next(f.word for f in isolation.layout.INPUT_FIELDS if f.name == FIELD)
    records = m.groups[0].bufs["k"].view(torch.int64)
    req = min(second.running, key=lambda r: r.rid)
    assert req.rid == 1 and req.matched == 0
    assert int(records[second.slot_of(req, 0), word]) == ri.namespace_of("b")


def test_records_store_the_writers_namespace(isolation):
    """Every record a running request wrote holds its own namespace; the tenants' namespaces differ."""
    m = CanaryManager(tree=isolation, mode="log", request_inputs=faults.SIM_REQUEST_INPUTS)
    engine = Engine(SIM, canary=m)
    engine.run(20)
    word = next(f.word for f in isolation.layout.INPUT_FIELDS if f.name == FIELD)
    records = m.groups[0].bufs["k"].view(torch.int64)
    seen = set()
    for req in engine.running:
        ns = ri.vllm_request_namespace(req)
        written = [engine.slot_of(req, p) for p in range(req.matched, req.kv_len)]
        assert written and all(int(records[s, word]) == ns for s in written)
        seen.add(ns)
    assert len(seen) == 2 and m.stats.total == 0


def test_from_config_takes_request_inputs_as_an_engine_option(isolation):
    from kv_canary.engine.config import CanaryConfig
    m = CanaryManager.from_config(CanaryConfig(mode="log"), tree=isolation, request_inputs=faults.SIM_REQUEST_INPUTS)
    engine = Engine(SIM, canary=m)
    engine.run(20)
    assert m.request_inputs is faults.SIM_REQUEST_INPUTS and m.kernel_runs > 0 and m.stats.total == 0
