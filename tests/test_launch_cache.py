"""The cached host launch path (kv_canary/launch_cache.py): a repeated launch reuses its validation and
binding, every check still fires - with the validators' own message - when one of its inputs changes
(a tensor swapped for one of another dtype, shape, device or pointer, a tensor changed in place, a
scalar, a real-KV source set), and results stay byte-identical to the reference when inputs change
between cached launches. Expected errors come from the plain, uncached validators."""
from __future__ import annotations

import dataclasses
import gc
import random
import re
import shutil
import weakref

import pytest
import scenarios
import torch

import kv_canary
from kv_canary.runtime import Runtime, runtime_for
from kv_canary.signature import python_signature
from kv_canary.validation import Validators

BACKENDS = ["torch", pytest.param("emulated", marks=pytest.mark.skipif(shutil.which("g++") is None,
                                                                       reason="g++ not installed"))]
LAUNCH = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
          "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}
LAYER = kv_canary.generated


# Every cache key comes from one signer per runtime: the native one (kv_canary/native, the default
# where it builds) or the Python one; the promises below hold for both.
SIGNERS = ["default", "python"]


def _runtime(signer: str, *, fresh: bool = False) -> Runtime:
    if signer == "python":
        return Runtime(LAYER, sign=python_signature)
    return Runtime(LAYER) if fresh else runtime_for(LAYER)


def _launch(kind: str, args: dict, backend: str, rt=None) -> None:
    getattr(rt or runtime_for(LAYER), LAUNCH[kind])(**args, backend=backend)


def _plain_error(kind: str, args: dict) -> BaseException:
    """What the uncached validators raise for `args` (the expected type and message)."""
    try:
        getattr(Validators(LAYER.layout), "validate_" + kind)(**args)
    except (TypeError, ValueError) as exc:
        return exc
    raise AssertionError(f"the plain validators accept this {kind} launch; the mutation is not an error")


def _raises_like(kind: str, args: dict, backend: str, rt=None) -> None:
    want = _plain_error(kind, args)
    with pytest.raises(type(want), match="^" + re.escape(str(want)) + "$"):
        _launch(kind, args, backend, rt)


def _case(kind: str, seed: int, **shape) -> dict:
    make = {"write": scenarios.make_write_case, "verify": scenarios.make_verify_case,
            "plan": scenarios.make_plan_case, "scatter": scenarios.make_scatter_case}[kind]
    return make(random.Random(seed), LAYER, **shape)


def _i64(values) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int64)


def _simple(kind: str) -> dict:
    """A small valid launch of `kind` whose every tensor has more than one element per dimension
    (so that shape and contiguity changes are visible)."""
    alloc, lay = kv_canary.allocators, LAYER.layout
    ctx = alloc.allocate_context(num_slots=16, ring_capacity=64, device="cpu", real_kv_sources=(_source(64, 16),),
                                 real_kv_hash_mode=lay.RealKvHashMode.ALL)
    if kind == "verify":
        plan = alloc.VerifyPlan.allocate(verify_capacity=8, device="cpu")
        plan.verify_slot_indices[:4] = _i64([3, 4, 5, 6])
        plan.verify_prev_slot_indices[:4] = _i64([-1, 3, 4, 5])
        plan.verify_expected_positions[:4] = _i64([0, 1, 2, 3])
        plan.verify_num_valid.fill_(4)
        return dict(context=ctx, plan=plan, check_verify_expected_token=True)
    if kind == "write":
        plan = alloc.WritePlan.allocate(write_req_capacity=2, device="cpu")
        plan.write_offsets[:3] = _i64([0, 2, 4])
        plan.write_num_valid_reqs.fill_(2)
        return dict(context=ctx, plan=plan, input_ids=_i64([7, 8, 9, 10]), positions=_i64([0, 1, 0, 1]),
                    out_cache_loc=_i64([3, 4, 5, 6]), enable_write_input_assert=False)
    if kind == "plan":
        return dict(verify_plan_out=alloc.VerifyPlan.allocate(verify_capacity=16, device="cpu"),
                    write_plan_out=alloc.WritePlan.allocate(write_req_capacity=2, device="cpu"),
                    req_pool_indices=_i64([1, 2]), prefix_lens=_i64([2, 3]), extend_seq_lens=_i64([1, 1]),
                    req_to_token=torch.arange(1, 25, dtype=torch.int32).view(3, 8), swa_window_size=0,
                    full_to_swa_index_mapping=None, verify_capacity=16)
    return dict(flat_in=_i64([5, 6, 7, 8, 9]), offsets=_i64([0, 2, 5]), req_pool_indices=_i64([1, 2]),
                pool_out=torch.zeros((3, 8), dtype=torch.int32))


def _source(nbytes: int = 64, rows: int = 8):
    return kv_canary.allocators.RealKvSource(tensor=torch.zeros((rows, nbytes), dtype=torch.uint8), page_size=1,
                                             num_bytes_per_token=nbytes, read_bytes=nbytes)


def _set(obj, name: str, value) -> None:
    """Rebind a field of a frozen dataclass in place (what an engine's own mutable class allows)."""
    object.__setattr__(obj, name, value)


# -- every cached check fires on a changed input ---------------------------------------------------------
def _swap(field: str, make):
    """A mutation: the plan or context rebuilt with `field` replaced by make(old tensor)."""
    def mutate(args: dict) -> None:
        holder = "plan" if "plan" in args and hasattr(args["plan"], field) else "context"
        if holder not in args:
            args[field] = make(args[field])
            return
        obj = args[holder]
        args[holder] = dataclasses.replace(obj, **{field: make(getattr(obj, field))})
    return mutate


def _arg(name: str, make):
    def mutate(args: dict) -> None:
        args[name] = make(args[name])
    return mutate


def _in_place(path: str, change):
    """A mutation of the very tensor object the cached launch saw (same identity)."""
    def mutate(args: dict) -> None:
        head, _, rest = path.partition(".")
        t = getattr(args[head], rest) if rest else args[head]
        change(t)
    return mutate


def _resize_in_place(t):
    t.resize_(t.shape[0] - 1)  # shrinking keeps the storage (and the data pointer)


def _other_dtype_in_place(t):
    t.data = t.to(torch.int16 if t.dtype != torch.int16 else torch.int64)


def _non_contiguous_in_place(t):
    """Same storage, same shape, transposed strides (a 2-D tensor with both dimensions > 1)."""
    t.as_strided_(t.shape, (1, t.shape[0]))


def _meta(t):
    return torch.zeros(t.shape, dtype=t.dtype, device="meta")


def _longer(t):
    return torch.zeros(t.shape[0] + 1, dtype=t.dtype)


def _int32(t):
    return t.to(torch.int32)


def _too_many_sources(args):
    ctx = args["context"]
    args["context"] = dataclasses.replace(ctx, real_kv_sources=[_source()] * (LAYER.layout.MAX_REAL_KV_SOURCES + 1))


def _source_field(name, value):
    def mutate(args):
        ctx = args["context"]
        sources = list(ctx.real_kv_sources) or [_source()]
        if not ctx.real_kv_sources:
            args["context"] = ctx = dataclasses.replace(ctx, real_kv_sources=sources)
        _set(sources[0], name, value(sources[0]) if callable(value) else value)
    return mutate


def _misaligned_source_tensor(src):
    """The same bytes one byte further on: only the data pointer (its alignment) changes."""
    t = src.tensor.reshape(src.tensor.shape[0], -1).view(torch.uint8)
    raw = torch.zeros(t.numel() + 1, dtype=torch.uint8)[1:].view(t.shape)
    return raw


MUTATIONS = {
    "verify": {
        "plan tensor of another dtype": _swap("verify_slot_indices", _int32),
        "plan tensor of another shape": _swap("verify_expected_tokens", _longer),
        "plan tensor on another device": _swap("enable", _meta),
        "plan tensor resized in place": _in_place("plan.verify_num_valid", _resize_in_place),
        "context tensor of another dtype in place": _in_place("context.violation_write_index", _other_dtype_in_place),
        "canary_buf made non-contiguous in place": _in_place("context.canary_buf", _non_contiguous_in_place),
        "flag given as an int": _arg("check_verify_expected_token", int),
        "kernel_kind out of the enum": lambda a: _set(a["context"], "kernel_kind", 999),
        "one real-KV source too many": _too_many_sources,
        "real-KV read_bytes not a multiple of 16": _source_field("read_bytes", 24),
        "real-KV source set grown in place": lambda a: a.update(context=dataclasses.replace(
            a["context"], real_kv_sources=list(a["context"].real_kv_sources))) or a["context"].real_kv_sources.extend(
            [_source()] * LAYER.layout.MAX_REAL_KV_SOURCES),
        "real-KV tensor moved to a misaligned pointer": _source_field("tensor", _misaligned_source_tensor),
    },
    "write": {
        "input_ids of another dtype": _arg("input_ids", _int32),
        "positions of another length": _arg("positions", _longer),
        "out_cache_loc on another device": _arg("out_cache_loc", _meta),
        "out_cache_loc resized in place": _in_place("out_cache_loc", _resize_in_place),
        "write plan resized in place": _in_place("plan.write_offsets", _resize_in_place),
        "input assert without expected inputs": lambda a: a.update(enable_write_input_assert=True,
                                                                   expected_input_tokens=None),
        "ring of another width": _swap("violation_ring", lambda t: torch.zeros((t.shape[0], t.shape[1] + 1),
                                                                                dtype=t.dtype)),
    },
    "plan": {
        "req_to_token of another dtype": _arg("req_to_token", lambda t: t.to(torch.int64)),
        "req_to_token made non-contiguous in place": _in_place("req_to_token", _non_contiguous_in_place),
        "swa_window_size past int64": _arg("swa_window_size", lambda w: 1 << 63),
        "verify_capacity not the plan's": _arg("verify_capacity", lambda c: c + 1),
        "prefix_lens resized in place": _in_place("prefix_lens", _resize_in_place),
        "verify plan array of another dtype": lambda a: a.update(
            verify_plan_out=dataclasses.replace(a["verify_plan_out"],
                                                verify_prev_slot_indices=_int32(a["verify_plan_out"].verify_prev_slot_indices))),
    },
    "scatter": {
        "pool_out of another dtype": _arg("pool_out", lambda t: t.to(torch.int64)),
        "offsets of another length": _arg("offsets", _longer),
        "flat_in on another device": _arg("flat_in", _meta),
    },
}


def _mutation_cases() -> list:
    return [pytest.param(kind, name, id=f"{kind}: {name}") for kind, mutations in MUTATIONS.items() for name in mutations]


@pytest.mark.parametrize("signer", SIGNERS)
@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind,mutation", _mutation_cases())
def test_a_changed_input_meets_its_check_after_a_cached_launch(kind, mutation, backend, signer):
    rt = _runtime(signer)
    args = _simple(kind)
    for _ in range(2):  # the second launch is served from the cache
        _launch(kind, args, backend, rt)
    MUTATIONS[kind][mutation](args)
    _raises_like(kind, args, backend, rt)
    _raises_like(kind, args, backend, rt)  # and again: failures are never cached


# -- cached launches give the reference's bytes when inputs change between them -------------------------------
def _run_sequence(kind: str, steps: list, backend: str) -> list:
    for args in steps:
        _launch(kind, args, backend)
    return steps


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_verify_with_new_plans_and_refilled_plans_matches_reference(backend):
    """One context, plans swapped (new pointers: the plan's part is rebound, the context's reused) and
    refilled in place (same pointers: a cache hit reading the new values)."""
    base = _case("verify", 11, n_reqs=4)
    ctx = dataclasses.replace(base["context"], violation_ring=torch.zeros((4096, LAYER.layout.VIOLATION_FIELDS),
                                                                         dtype=torch.int64))
    other = scenarios.clone_case(base)["plan"]
    other.verify_expected_positions.add_(1)  # every entry of the second plan now reports a mismatch
    refill = _i64([random.Random(3).randrange(-1, 9) for _ in range(other.verify_expected_tokens.shape[0])])
    states = {}
    for b in ("torch", backend):
        case = scenarios.clone_case(dict(context=ctx, plan=base["plan"], plan2=other))
        common = dict(context=case["context"], check_verify_expected_token=True, extra_slot_tables={})
        first, second = dict(common, plan=case["plan"]), dict(common, plan=case["plan2"])
        _run_sequence("verify", [first, second, first], b)
        case["plan"].verify_expected_tokens.copy_(refill)
        _run_sequence("verify", [first], b)
        states[b] = case
    scenarios.compare_state(states["torch"], states[backend], ring_as_multiset=True)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_write_with_new_input_tensors_each_launch_matches_reference(backend):
    """Like an engine's steps: the same context and plan, new input tensors at every launch (their
    parameters rebound, the context's and plan's reused)."""
    base = _case("write", 21, n_reqs=3)
    states = {}
    for b in ("torch", backend):
        case = scenarios.clone_case(base)
        for step in range(3):
            inputs = {k: case[k].clone() for k in ("input_ids", "positions", "out_cache_loc")}
            inputs["input_ids"] += step
            _launch("write", dict(case, **inputs), b)
        states[b] = case
    scenarios.compare_state(states["torch"], states[backend], ring_as_multiset=True)


@pytest.mark.parametrize("backend", BACKENDS[1:])
def test_plan_launched_repeatedly_with_new_batches_matches_reference(backend):
    """The prepared plan allocates and binds its scratch array at every launch."""
    base = _case("plan", 31, n_reqs=5)
    states = {}
    for b in ("torch", backend):
        case = scenarios.clone_case(base)
        for step in range(3):
            batch = {k: case[k].clone() for k in ("req_pool_indices", "prefix_lens", "extend_seq_lens")}
            batch["prefix_lens"].clamp_(max=max(0, int(case["req_to_token"].shape[1]) - step))
            _launch("plan", dict(case, **batch), b)
        states[b] = case
    scenarios.compare_state(states["torch"], states[backend])


def _moved(kind: str, case: dict, step: int) -> dict:
    """The launch of `case` with its per-step inputs replaced by new tensors (new addresses, same
    shapes) whose values differ at each step, so that a launch still reading last step's tensors
    would end in other bytes than the reference."""
    if kind == "write":
        return dict(case, input_ids=case["input_ids"] + step, positions=case["positions"].clone(),
                    out_cache_loc=case["out_cache_loc"].clone())
    if kind == "plan":
        return dict(case, req_pool_indices=case["req_pool_indices"].clone(),
                    prefix_lens=(case["prefix_lens"] - step).clamp_(min=0),
                    extend_seq_lens=case["extend_seq_lens"].clone())
    if kind == "scatter":
        return dict(case, flat_in=case["flat_in"] + step, offsets=case["offsets"].clone())
    plan = scenarios.clone_case({"plan": case["plan"]})["plan"]
    plan.verify_expected_positions.add_(step)  # a mismatch per entry from step 1 on
    return dict(case, plan=plan)


@pytest.mark.parametrize("signer", SIGNERS)
@pytest.mark.parametrize("backend", BACKENDS[1:])
@pytest.mark.parametrize("kind", ["write", "verify", "plan", "scatter"])
def test_inputs_moved_every_launch_are_validated_once_rebound_and_match_reference(kind, backend, signer, monkeypatch):
    """An engine's fresh batch tensors: every launch misses the cache but not its shape, so
    validation runs once and only the moved arguments are rebound."""
    base = _case(kind, 41, n_reqs=3)
    states = {}
    for b in ("torch", backend):
        rt = _runtime(signer, fresh=True)
        calls = []
        validate = getattr(rt.validators, "validate_" + kind)
        monkeypatch.setattr(rt.validators, "validate_" + kind, lambda **kw: calls.append(1) or validate(**kw))
        case, launched = scenarios.clone_case(base), []
        for step in range(4):
            launched.append(_moved(kind, case, step))  # all kept alive: every step's tensors have new addresses
            _launch(kind, launched[-1], b, rt)
        assert len(calls) == 1
        states[b] = case
    scenarios.compare_state(states["torch"], states[backend], ring_as_multiset=True)


# -- the cache does what it promises ---------------------------------------------------------------------------
@pytest.mark.parametrize("signer", SIGNERS)
def test_validation_runs_once_per_signature_and_once_per_shape(monkeypatch, signer):
    """A repeated launch validates once; new tensors of the same shapes (an engine's fresh batch
    tensors) are not validated again; a changed flag is a new shape."""
    rt = _runtime(signer, fresh=True)
    calls = []
    validate = rt.validators.validate_verify
    monkeypatch.setattr(rt.validators, "validate_verify", lambda **kw: calls.append(1) or validate(**kw))
    args = _case("verify", 2, n_reqs=2)
    for _ in range(3):
        _launch("verify", args, "torch", rt)
    assert len(calls) == 1
    _launch("verify", dict(args, plan=scenarios.clone_case(args)["plan"]), "torch", rt)  # other pointers
    assert len(calls) == 1
    _launch("verify", dict(args, check_verify_expected_token=not args["check_verify_expected_token"]), "torch", rt)
    assert len(calls) == 2


def test_checks_read_addresses_only_for_alignments_within_the_pointer_class():
    """The shape cache (launch_cache.py) keeps each data pointer modulo the validators'
    pointer_class_bytes: validation.py may read an address only in Validators.address_misaligned
    (which refuses an alignment that does not divide the class) or to word an error it raises."""
    import ast
    import inspect

    import kv_canary.validation as validation
    tree = ast.parse(inspect.getsource(validation))
    reads = []

    def visit(node, function=None, in_raise=False):
        for child in ast.iter_child_nodes(node):
            fn = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            if isinstance(child, ast.Attribute) and child.attr in ("data_ptr", "untyped_storage", "storage"):
                reads.append((child.lineno, fn, in_raise))
            visit(child, fn, in_raise or isinstance(child, ast.Raise))
    visit(tree)
    assert reads and all(fn == "address_misaligned" or in_raise for _, fn, in_raise in reads), reads
    v = Validators(LAYER.layout)
    assert v.pointer_class_bytes >= LAYER.layout.REAL_KV_LOAD_ALIGN_BYTES and v.pointer_class_bytes % 16 == 0
    with pytest.raises(AssertionError, match="does not divide the pointer class"):
        v.address_misaligned(torch.zeros(4), v.pointer_class_bytes * 2)


def test_a_misaligned_copy_of_a_validated_shape_is_still_refused():
    """Same shape, same dtype, an address one byte off: another pointer class, so the checks run."""
    import numpy as np
    args = _simple("write")
    _launch("write", args, "torch")
    raw = np.zeros(4 * 8 + 1, dtype=np.uint8)[1:].view(np.int64)
    args["input_ids"] = torch.from_numpy(raw)
    assert args["input_ids"].data_ptr() % 8
    _raises_like("write", args, "torch")


@pytest.mark.parametrize("signer", SIGNERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_cached_launches_keep_no_tensor_alive(backend, signer):
    rt = _runtime(signer, fresh=True)
    args = _case("verify", 4, n_reqs=2)
    _launch("verify", args, backend, rt)
    _launch("verify", args, backend, rt)
    refs = [weakref.ref(t) for t in scenarios._tensors(args, "", {}).values()]
    del args
    gc.collect()
    assert all(r() is None for r in refs)


def test_bind_returns_the_launch_without_running_it():
    args = _case("verify", 6, n_reqs=2)
    runs = int(args["context"].kernel_run_counter[0])
    launch = runtime_for(LAYER).bind("launch_canary_verify_kernel", **args, backend="torch")
    assert int(args["context"].kernel_run_counter[0]) == runs
    launch()
    assert int(args["context"].kernel_run_counter[0]) == runs + 1
    with pytest.raises(ValueError, match="has no launch named 'launch_nothing'"):
        runtime_for(LAYER).bind("launch_nothing")


# -- the pieces: signatures, packed arguments, binding parts ---------------------------------------------------
@pytest.mark.parametrize("signer", SIGNERS)
def test_signatures_tell_apart_what_the_checks_tell_apart(signer):
    from kv_canary.signature import Unsignable
    signature = _runtime(signer).sign
    t = torch.zeros((4, 4), dtype=torch.int64)
    same = [t, t.view(4, 4)]  # another object over the same bytes with the same properties
    assert signature(same[0]) == signature(same[1])
    different = [t[:2], t.t(), t.view(torch.float64), torch.zeros((4, 4), dtype=torch.int64),
                 torch.zeros((4, 4), dtype=torch.int64, device="meta"), t.view(16)]
    sigs = [signature(x) for x in (t, *different)]
    assert len(set(sigs)) == len(sigs)
    assert signature(True) != signature(1) and signature(1) != signature(1.0)
    assert signature(10**30) == signature(int("1" + "0" * 30))  # equal values, distinct objects
    tag = LAYER.layout.CanaryLaunchTag(1)
    assert signature(tag) != signature(1) and signature(tag) == signature(LAYER.layout.CanaryLaunchTag(1))
    sources = [_source()]
    before = signature(sources)
    sources.append(_source())
    assert signature(sources) != before
    assert signature({"a": t}) != signature({"b": t})
    with pytest.raises(Unsignable):
        signature(object())


def test_packed_arguments_hold_each_value_as_its_c_type_reads_it():
    """What cuLaunchKernel and the emulation's packed launchers read through the pointer array: a
    pointer or long long as 8 bytes, an int as the slot's first 4 bytes (two's complement)."""
    import ctypes

    from kv_canary.cuda.params import KernelParams
    kinds = ("ptr", "i64", "i32", "i64", "i32")
    values = [0x7F00_1234_5678, -(1 << 63), -(1 << 31), (1 << 63) - 1, 7]
    params = KernelParams(kinds, values)
    pointers = ctypes.cast(params.address, ctypes.POINTER(ctypes.c_void_p))
    read = {"ptr": ctypes.c_uint64, "i64": ctypes.c_int64, "i32": ctypes.c_int32}
    assert [read[k].from_address(pointers[i]).value for i, k in enumerate(kinds)] == values
    params.set(2, 123)
    assert ctypes.c_int32.from_address(pointers[2]).value == 123 and params.values[2] == 123
    with pytest.raises(ValueError, match="5 kernel parameters need 5 values, got 4"):
        KernelParams(kinds, values[:4])


@pytest.mark.parametrize("kind,templates", [("write", ("write",)), ("verify", ("verify",)),
                                            ("plan", ("plan_offsets", "plan_entries")), ("scatter", ("scatter",))])
def test_binding_parts_give_the_whole_binding(any_layer, kind, templates):
    """KernelAbi.parts, assembled, equal KernelAbi.bind for the same arguments (both generated)."""
    from kv_canary.cuda.kernel_backend import KernelBackend
    from kv_canary.cuda.sources import kernel_abi
    abi = kernel_abi(any_layer)
    rt = runtime_for(any_layer)
    for seed in range(4):
        case = {"write": scenarios.make_write_case, "verify": scenarios.make_verify_case,
                "plan": scenarios.make_plan_case, "scatter": scenarios.make_scatter_case}[kind](random.Random(seed), any_layer)
        validated = getattr(rt.validators, "validate_" + kind)(**case)
        stages = dict(zip(templates, KernelBackend.plan_stage_args(validated, torch.zeros(3, dtype=torch.int64))
                          if kind == "plan" else (validated,)))
        for template in templates:
            args = stages[template]
            kernel = abi.kernel_for_template(template)
            names = kernel.bind.__code__.co_varnames[:kernel.bind.__code__.co_kwonlyargcount]
            whole = kernel.bind(**{n: abi.real_kv_args(args["context"]) if n == "kv" else args[n] for n in names})
            parts = [None] * len(whole)
            for roots, indices, part in kernel.parts:
                for i, value in zip(indices, part(*(args[r] for r in roots))):
                    parts[i] = value
            assert parts == list(whole)
