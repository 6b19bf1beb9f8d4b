"""SGLang's public names beyond the four launches (docs/sglang-compat.md, "Names"):
the plan's two stages callable one by one, the scatter's launcher name, compute_slot_hash,
use_torch_reference and the plans' zero_for_testing_(), each through the public API.

The stages are checked three ways: against the scalar oracle's stages (scratch included), against
one launch_canary_plan_kernels call on the same backend, and emulated against torch (scratch
included). tests/gpu/test_gpu_backend.py does the same on `cuda`.
"""
from __future__ import annotations

import inspect
import random
import re
import shutil

import pytest
import torch
from support import budget, scenarios
from support.kernel_diff import run_plan_stages
from support.oracle import Canary, Oracle
from support.trees import EXAMPLE_SCHEMAS, generate_tree, load_vectors

import kv_canary
import kv_canary.launch.runtime as runtime_module
from kv_canary.backends import Prepared
from kv_canary.launch import operations

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
HOST_BACKENDS = ["torch", pytest.param("cpu", marks=needs_gxx), pytest.param("emulated", marks=needs_gxx)]
OWNER_EPOCH = next(p for p in EXAMPLE_SCHEMAS if p.stem == "owner_epoch")

# SGLang's keyword-only parameters, in its order (sglang/kernels/ops/kv_canary/plan/offsets_kernel.py,
# entries_kernel.py, scatter_req_token_ids.py).
SGLANG_PARAMS = {
    "launch_plan_offsets_kernel": (
        "req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token", "full_to_swa_index_mapping",
        "out_verify_offsets_scratch", "out_write_offsets", "out_write_seed_slot_indices", "out_verify_num_valid",
        "out_verify_enable", "out_write_num_valid_reqs", "swa_window_size", "verify_capacity"),
    "launch_plan_entries_kernel": (
        "req_pool_indices", "prefix_lens", "req_to_token", "full_to_swa_index_mapping", "verify_offsets_scratch",
        "verify_enable", "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens",
        "out_verify_slot_indices", "out_verify_expected_tokens", "out_verify_expected_positions",
        "out_verify_prev_slot_indices", "kv_token_id_vs_position_offset", "swa_window_size"),
    "launch_scatter_req_token_ids_kernel": ("flat_in", "offsets", "req_pool_indices", "pool_out"),
}


def _kernels_only(backend, operation: str, **args) -> None:
    """The operation's kernels alone, without the host backend's value checks (as on a GPU)."""
    backend.prepare(operations.BY_NAME[operation], args).run()


def cases_for(tree) -> int:
    return budget.cases(30 if tree is kv_canary.generated else 10)


# -- names and signatures -----------------------------------------------------------------------------
def test_every_name_is_importable_from_kv_canary():
    for name in (*SGLANG_PARAMS, "compute_slot_hash", "use_torch_reference"):
        assert callable(getattr(kv_canary, name)), name
        assert name in kv_canary.generated.api.__all__ and name in dir(kv_canary), name
    assert callable(kv_canary.VerifyPlan.zero_for_testing_) and callable(kv_canary.WritePlan.zero_for_testing_)
    from kv_canary import launch_plan_entries_kernel, launch_plan_offsets_kernel  # noqa: F401  (import form)
    # SGLang has no torch-reference variant of these three: neither has kv-canary.
    for name in SGLANG_PARAMS:
        assert not hasattr(kv_canary, name + "_torch_reference"), name
        with pytest.raises(AttributeError):
            getattr(kv_canary.generated.api, name + "_torch_reference")


def test_launch_signatures_are_sglangs(default_tree):
    for name, sglang in SGLANG_PARAMS.items():
        params = inspect.signature(getattr(kv_canary, name)).parameters
        assert tuple(params) == sglang + ("backend",), name
        assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in params.values()), name
        assert all(p.default is inspect.Parameter.empty for n, p in params.items() if n != "backend"), name
    assert tuple(inspect.signature(kv_canary.compute_slot_hash).parameters) == ("buf_i64", "source_slot_idx")
    params = inspect.signature(kv_canary.use_torch_reference).parameters
    assert tuple(params) == ("device", "backend") and params["backend"].kind is inspect.Parameter.KEYWORD_ONLY


def test_entries_stage_takes_the_schemas_field_keywords():
    """A schema that verifies per-request fields (docs/semantics.md §8) hands their values and output
    arrays to the entries stage; the offsets stage never sees them."""
    api = generate_tree(OWNER_EPOCH).api
    params = tuple(inspect.signature(api.launch_plan_entries_kernel).parameters)
    assert params == SGLANG_PARAMS["launch_plan_entries_kernel"] + (
        "extra_request_values", "out_extra_verify_expected", "backend")
    assert tuple(inspect.signature(api.launch_plan_offsets_kernel).parameters) == (
        SGLANG_PARAMS["launch_plan_offsets_kernel"] + ("backend",))


# -- zero_for_testing_ --------------------------------------------------------------------------------
@pytest.mark.parametrize("schema", [None, OWNER_EPOCH], ids=["default", "owner_epoch"])
def test_zero_for_testing_resets_every_plan_tensor_in_place(schema):
    tree = kv_canary.generated if schema is None else generate_tree(schema)
    alloc = tree.allocators
    vplan = alloc.VerifyPlan.allocate(verify_capacity=5, device="cpu")
    tensors = {name: getattr(vplan, name) for name in (*vplan.ARRAY_FIELDS, "verify_num_valid", "enable")}
    for t in tensors.values():
        t.fill_(7)
    assert vplan.zero_for_testing_() is vplan
    for name, t in tensors.items():
        assert getattr(vplan, name) is t, name  # in place: a captured graph keeps its addresses
        # SGLang's reset: the expected values go to -1 (unknown), everything else to 0.
        unknown = name.startswith("verify_expected_") and name != "verify_expected_positions"
        assert torch.equal(t, torch.full_like(t, -1 if unknown else 0)), name
    if schema is not None:  # its per-request expected arrays were reset too
        assert len(vplan.ARRAY_FIELDS) > 4
    wplan = alloc.WritePlan.allocate(write_req_capacity=3, device="cpu")
    arrays = (wplan.write_offsets, wplan.write_seed_slot_indices, wplan.write_num_valid_reqs)
    for t in arrays:
        t.fill_(-5)
    assert wplan.zero_for_testing_() is wplan
    assert all(torch.equal(t, torch.zeros_like(t)) for t in arrays)
    assert (wplan.write_offsets, wplan.write_seed_slot_indices, wplan.write_num_valid_reqs) == arrays


# -- the plan's two stages ----------------------------------------------------------------------------
def _oracle_stages(tree, case: dict, scratch: torch.Tensor) -> None:
    offsets, entries = scenarios.plan_stages(tree, case, scratch)
    Oracle(tree).plan_offsets(**offsets)
    Oracle(tree).plan_entries(**entries)


def test_torch_stages_match_the_oracle(any_tree):
    """The reference's stages against the oracle's, scratch included (its entries past bs + 1 untouched)."""
    for seed in range(cases_for(any_tree)):
        rng = random.Random(seed)
        case = scenarios.make_plan_case(rng, any_tree)
        scratch = scenarios.make_plan_scratch(rng, case)
        got, want = scenarios.clone_case(case), scenarios.clone_case(case)
        got_scratch, want_scratch = scratch.clone(), scratch.clone()
        run_plan_stages(any_tree, got, got_scratch, "torch")
        _oracle_stages(any_tree, want, want_scratch)
        try:
            scenarios.compare_state(got, want)
            scenarios.compare_state({"scratch": got_scratch}, {"scratch": want_scratch})
        except AssertionError as exc:
            raise AssertionError(f"plan stages seed={seed} ({any_tree.__name__}): {exc}") from None


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_offsets_then_entries_equals_one_plan_call(any_tree, backend):
    """On each host backend, the two stages leave the plans exactly as launch_canary_plan_kernels does
    (itself checked against the oracle elsewhere), and the emulated kernels fill the same scratch as
    the reference."""
    rt = scenarios.runtime_for(any_tree)
    for seed in range(cases_for(any_tree)):
        rng = random.Random(seed)
        case = scenarios.make_plan_case(rng, any_tree)
        scratch = scenarios.make_plan_scratch(rng, case)
        whole, staged, ref = (scenarios.clone_case(case) for _ in range(3))
        rt.launch_canary_plan_kernels(**whole, backend=backend)
        staged_scratch, ref_scratch = scratch.clone(), scratch.clone()
        run_plan_stages(any_tree, staged, staged_scratch, backend)
        run_plan_stages(any_tree, ref, ref_scratch, "torch")
        try:
            scenarios.compare_state(staged, whole)
            scenarios.compare_state({"scratch": staged_scratch}, {"scratch": ref_scratch})
        except AssertionError as exc:
            raise AssertionError(f"plan stages seed={seed} on {backend} ({any_tree.__name__}): {exc}") from None


def _small_case(tree, seed: int = 3) -> tuple[dict, torch.Tensor]:
    """A 4-request plan case whose plan does not overflow and has verify entries."""
    rng = random.Random(seed)
    while True:
        case = scenarios.make_plan_case(rng, tree, n_reqs=4)
        scratch = scenarios.make_plan_scratch(rng, case)
        probe = scenarios.clone_case(case)
        scenarios.runtime_for(tree).launch_plan_offsets_kernel(**scenarios.plan_stages(tree, probe, scratch.clone())[0])
        if int(probe["verify_plan_out"].enable[0]) == 1 and int(probe["verify_plan_out"].verify_num_valid[0]) > 1:
            return case, scratch


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_entries_stage_of_a_disabled_plan_writes_nothing(default_tree, backend):
    case, scratch = _small_case(default_tree)
    _, entries = scenarios.plan_stages(default_tree, case, scratch)
    entries["verify_enable"].fill_(0)
    entries["verify_offsets_scratch"].fill_(-7)   # never read: any values pass
    before = scenarios.clone_case(case)
    kv_canary.launch_plan_entries_kernel(**entries, backend=backend)
    scenarios.compare_state(case, before)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_entries_stage_rejects_a_scratch_the_offsets_stage_did_not_fill(default_tree, backend):
    case, scratch = _small_case(default_tree)
    offsets, entries = scenarios.plan_stages(default_tree, case, scratch)
    kv_canary.launch_plan_offsets_kernel(**offsets, backend="torch")
    filled = scratch.clone()
    scratch[1] += 1
    before = scenarios.clone_case(case)
    msg = (f"kv-canary: verify_offsets_scratch[1] = {int(filled[1]) + 1}, but this batch's verify offsets give "
           f"{int(filled[1])}: pass the scratch launch_plan_offsets_kernel filled for the same requests")
    with pytest.raises(ValueError, match="^" + re.escape(msg) + "$"):
        kv_canary.launch_plan_entries_kernel(**entries, backend=backend)
    scenarios.compare_state(case, before)   # nothing written
    # An enabled plan with more entries than its capacity: the offsets stage would have disabled it.
    scratch.copy_(filled)
    total = int(filled[int(case["req_pool_indices"].shape[0])])
    small = torch.zeros(total - 1, dtype=torch.int64)
    entries.update(out_verify_slot_indices=small, out_verify_expected_tokens=small.clone(),
                   out_verify_expected_positions=small.clone(), out_verify_prev_slot_indices=small.clone())
    with pytest.raises(ValueError, match=rf"^kv-canary: verify_enable is 1 but the batch has {total} verify entries, "
                                         rf"more than the capacity {total - 1} \(out_verify_slot_indices length\)"):
        kv_canary.launch_plan_entries_kernel(**entries, backend=backend)


@needs_gxx
def test_entries_kernel_takes_any_scratch_without_leaving_its_tensors(default_tree):
    """What the cuda backend does (it cannot read the scratch to check it): the kernel, without the
    host checks, writes at most min(scratch[bs], capacity) entries and reads nothing out of bounds
    (a scratch claiming entries for an empty batch included)."""
    rt = scenarios.runtime_for(default_tree)
    emulated = rt.backend("emulated")
    case, scratch = _small_case(default_tree)
    empty = scenarios.clone_case(case)
    for name in ("req_pool_indices", "prefix_lens", "extend_seq_lens"):
        empty[name] = empty[name][:0]
    _, entries = scenarios.plan_stages(default_tree, empty, torch.tensor([5], dtype=torch.int64))
    entries["verify_enable"].fill_(1)
    before = scenarios.clone_case(entries)
    _kernels_only(emulated, "plan_entries", **operations.BY_NAME["plan_entries"].validate(rt.validators, entries))
    scenarios.compare_state(entries, before)
    cap = int(case["verify_capacity"])
    for seed, claimed in enumerate((2, cap + 7)):
        _, entries = scenarios.plan_stages(default_tree, scenarios.clone_case(case), scratch.clone())
        bs = int(case["req_pool_indices"].shape[0])
        entries["verify_offsets_scratch"][: bs + 1] = torch.tensor([0, 9, -4, 1 << 40, 3][:bs] + [claimed])
        entries["verify_enable"].fill_(1)
        before = scenarios.clone_case(entries)
        _kernels_only(emulated, "plan_entries", **operations.BY_NAME["plan_entries"].validate(rt.validators, entries))
        written = min(claimed, cap)
        for name in ("out_verify_slot_indices", "out_verify_expected_positions", "out_verify_prev_slot_indices"):
            assert torch.equal(entries[name][written:], before[name][written:]), (seed, name)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_stages_raise_the_plans_swa_error(default_tree, backend):
    """The offsets stage translates the write seeds, the entries stage the slots then predecessors:
    an index outside the LUT raises the §7 text from the stage that reads it, before it writes."""
    lut = torch.arange(10, dtype=torch.int64)
    r2t = torch.tensor([[0, 0, 0], [1, 2, 3], [4, 12, 11]], dtype=torch.int32)
    case = dict(verify_plan_out=kv_canary.VerifyPlan.allocate(verify_capacity=8, device="cpu"),
                write_plan_out=kv_canary.WritePlan.allocate(write_req_capacity=2, device="cpu"),
                req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([3, 3]),
                extend_seq_lens=torch.tensor([0, 1]), req_to_token=r2t, swa_window_size=2,
                full_to_swa_index_mapping=lut, verify_capacity=8, req_to_verify_expected_tokens=None,
                req_to_verify_expected_tokens_valid_lens=None, kv_token_id_vs_position_offset=0)
    offsets, entries = scenarios.plan_stages(default_tree, case, torch.zeros(3, dtype=torch.int64))
    # Row 2's seed (position 2) is slot 11; its window [1, 3) reads slots 12, 11, predecessors 4, 12.
    before = scenarios.clone_case(offsets)
    with pytest.raises(ValueError, match=r"^kv-canary: SWA slot 11 is outside full_to_swa_index_mapping length 10$"):
        kv_canary.launch_plan_offsets_kernel(**offsets, backend=backend)
    scenarios.compare_state(offsets, before)
    offsets["extend_seq_lens"] = torch.tensor([0, 0])   # no write seed to translate: the stage runs
    kv_canary.launch_plan_offsets_kernel(**offsets, backend=backend)
    assert int(entries["verify_enable"][0]) == 1
    before = scenarios.clone_case(entries)
    with pytest.raises(ValueError, match=r"^kv-canary: SWA slot 12 is outside full_to_swa_index_mapping length 10$"):
        kv_canary.launch_plan_entries_kernel(**entries, backend=backend)
    scenarios.compare_state(entries, before)


def test_stage_arguments_are_validated_by_name(default_tree):
    case, scratch = _small_case(default_tree)
    offsets, entries = scenarios.plan_stages(default_tree, case, scratch)
    bs = int(case["req_pool_indices"].shape[0])
    short = dict(offsets, out_verify_offsets_scratch=torch.zeros(bs, dtype=torch.int64))
    with pytest.raises(ValueError, match=rf"^kv-canary: out_verify_offsets_scratch must hold at least bs \+ 1 = "
                                         rf"{bs + 1} int64 entries \(bs = req_pool_indices length\), got shape \({bs},\)$"):
        kv_canary.launch_plan_offsets_kernel(**short)
    with pytest.raises(TypeError, match=r"^kv-canary: out_verify_enable must have dtype torch.int32, got torch.int64$"):
        kv_canary.launch_plan_offsets_kernel(**dict(offsets, out_verify_enable=torch.zeros(1, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"^kv-canary: out_write_offsets must have shape \("):
        kv_canary.launch_plan_offsets_kernel(**dict(offsets, out_write_offsets=torch.zeros(1, dtype=torch.int64)))
    with pytest.raises(ValueError, match=rf"^kv-canary: req_pool_indices holds {bs} requests but the write request "
                                         rf"capacity \(out_write_seed_slot_indices length\) is {bs - 1}$"):
        kv_canary.launch_plan_offsets_kernel(**dict(
            offsets, out_write_seed_slot_indices=torch.zeros(bs - 1, dtype=torch.int64),
            out_write_offsets=torch.zeros(bs, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"^kv-canary: out_verify_prev_slot_indices must have shape \("):
        kv_canary.launch_plan_entries_kernel(**dict(entries, out_verify_prev_slot_indices=torch.zeros(
            int(entries["out_verify_slot_indices"].shape[0]) + 1, dtype=torch.int64)))
    with pytest.raises(ValueError, match=r"^kv-canary: req_to_verify_expected_tokens and "
                                         r"req_to_verify_expected_tokens_valid_lens must be given together, got only "
                                         r"req_to_verify_expected_tokens$"):
        kv_canary.launch_plan_entries_kernel(**dict(
            entries, req_to_verify_expected_tokens=torch.zeros((2, 2), dtype=torch.int32),
            req_to_verify_expected_tokens_valid_lens=None))
    with pytest.raises(ValueError, match=r"^kv-canary: verify_offsets_scratch must hold at least bs \+ 1"):
        kv_canary.launch_plan_entries_kernel(**dict(entries, verify_offsets_scratch=torch.zeros(0, dtype=torch.int64)))


# -- launch_scatter_req_token_ids_kernel ----------------------------------------------------------------
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_scatter_launcher_name_is_scatter_req_token_ids(backend):
    assert kv_canary.generated.api.LAUNCHES["launch_scatter_req_token_ids_kernel"] == \
        kv_canary.generated.api.LAUNCHES["scatter_req_token_ids"]
    for seed in range(10):
        case = scenarios.make_scatter_case(random.Random(seed), kv_canary.generated)
        by_alias, by_name, want = (scenarios.clone_case(case) for _ in range(3))
        kv_canary.launch_scatter_req_token_ids_kernel(**by_alias, backend=backend)
        kv_canary.scatter_req_token_ids(**by_name, backend=backend)
        Oracle(kv_canary.generated).scatter(**want)
        scenarios.compare_state(by_alias, want)
        scenarios.compare_state(by_name, want)


# -- compute_slot_hash ----------------------------------------------------------------------------------
def _chain_buffer(records: list[tuple[int, int, int]], tree=kv_canary.generated) -> torch.Tensor:
    """A canary buffer with records (token, position, prev_hash as int64) at slots 1, 2, ..."""
    lay = tree.layout
    buf = tree.allocators.allocate_canary_buf(len(records) + 1, device="cpu")
    words = buf.view(torch.int64)
    for slot, (token, position, prev) in enumerate(records, start=1):
        words[slot, lay.CANARY_TOKEN_WORD] = token
        words[slot, lay.CANARY_POSITION_WORD] = position
        words[slot, lay.CANARY_CHAIN_LINK_WORD] = prev
    return buf


def test_compute_slot_hash_reproduces_the_golden_chain():
    vectors = load_vectors()
    chain = vectors["chain_example"]
    records = chain["records"]
    buf = _chain_buffer([(r["token"], r["position"], r["prev_hash_i64"]) for r in records])
    links = [int(r["prev_hash_u64"], 16) for r in records[1:]] + [int(chain["next_link_after_last"], 16)]
    for form in (buf, buf.view(torch.int64)):   # the uint8 canary_buf, and SGLang's int64 view
        assert kv_canary.compute_slot_hash(form, -1) == int(chain["head_hash"], 16)
        assert [kv_canary.compute_slot_hash(form, s) for s in range(1, len(records) + 1)] == links
    neg = vectors["link_negative"]
    buf = _chain_buffer([(neg["token"], neg["position"], int(neg["prev"], 16))])
    assert kv_canary.compute_slot_hash(buf.view(torch.int64), source_slot_idx=1) == int(neg["link"], 16)


def test_compute_slot_hash_matches_the_oracle(any_tree):
    """Random records, through the schema's own chain fold (extra chained fields included)."""
    api = any_tree.api
    oracle = Oracle(any_tree)
    rng = random.Random(5)
    for n in (1, 3, 17):
        buf = any_tree.allocators.allocate_canary_buf(n, device="cpu")
        buf.copy_(torch.randint(0, 256, buf.shape, dtype=torch.uint8, generator=torch.Generator().manual_seed(n)))
        words = buf.view(torch.int64)
        canary = Canary(buf)
        slots = [-1, -rng.randrange(2, 1 << 40), *range(n)]
        for s in slots:
            want = oracle.slot_hash(canary, s)
            assert api.compute_slot_hash(words, s) == want == api.compute_slot_hash(buf, s), (n, s)
        # A strided int64 view (only the record's words of each slot) reads the same records.
        record = words[:, : any_tree.layout.CANARY_FIELDS_PER_SLOT]
        assert [api.compute_slot_hash(record, s) for s in range(n)] == [oracle.slot_hash(canary, s) for s in range(n)]


def test_compute_slot_hash_rejects_bad_input_by_name():
    buf = kv_canary.allocate_canary_buf(4, device="cpu")
    words = buf.view(torch.int64)
    with pytest.raises(ValueError, match=r"^kv-canary: source_slot_idx must be < 4 \(the slots of buf_i64\) or "
                                         r"negative \(the chain head\), got 4$"):
        kv_canary.compute_slot_hash(words, 4)
    with pytest.raises(TypeError, match=r"^kv-canary: source_slot_idx must be an int, got bool$"):
        kv_canary.compute_slot_hash(words, True)
    with pytest.raises(TypeError, match=r"^kv-canary: buf_i64 must have dtype torch.int64 \(the canary buffer viewed "
                                        r"as int64 \[num_slots, words\]\) or be the uint8 canary_buf, got torch.float32$"):
        kv_canary.compute_slot_hash(torch.zeros((4, 4)), 0)
    fields = kv_canary.CANARY_FIELDS_PER_SLOT
    with pytest.raises(ValueError, match=rf"^kv-canary: buf_i64 must hold at least {fields} int64 fields per slot "
                                         rf"\(dim 1\), got shape \(4, {fields - 1}\)$"):
        kv_canary.compute_slot_hash(words[:, : fields - 1], 0)
    assert kv_canary.compute_slot_hash(words, __import__("numpy").int64(2)) == kv_canary.compute_slot_hash(words, 2)


# -- use_torch_reference --------------------------------------------------------------------------------
def _no_cpu_backend(self, name):
    if name == "cpu":
        raise ValueError("kv-canary: backend 'cpu' is not available: no compiler here")
    return runtime_module.get_backend(name, self.tree)


def test_use_torch_reference_composes_with_backend_and_the_environment(monkeypatch):
    monkeypatch.delenv(runtime_module.ENV_BACKEND, raising=False)
    ask = kv_canary.use_torch_reference
    assert ask(torch.device("cpu")) is False and ask("cpu") is False        # CPU tensors: the native cpu kernels
    assert ask("cpu", backend="torch") is True                               # the keyword picks the reference
    assert ask("cpu", backend="emulated") is False                           # ... or other kernels
    monkeypatch.setattr(runtime_module.Runtime, "backend", _no_cpu_backend)
    monkeypatch.setattr(kv_canary.runtime_for(kv_canary.generated), "_cpu_unavailable", False)
    with pytest.warns(RuntimeWarning, match="CPU tensors run on the torch reference instead"):
        assert ask("cpu") is True                                            # no compiler: the reference runs
    monkeypatch.undo()
    monkeypatch.delenv(runtime_module.ENV_BACKEND, raising=False)
    monkeypatch.setattr(runtime_module, "cupy_sees_a_device", lambda: True)
    assert ask(torch.device("cuda", 0)) is False                             # SGLang: CUDA -> kernels
    assert ask("cuda", backend="torch") is True
    monkeypatch.setattr(runtime_module, "cupy_sees_a_device", lambda: False)
    assert ask("cuda") is True                                               # no GPU for CuPy: reference
    monkeypatch.setenv(runtime_module.ENV_BACKEND, "emulated")
    assert ask("cpu") is False                                               # the environment variable
    assert ask("cpu", backend="torch") is True                               # the keyword wins over it
    monkeypatch.setenv(runtime_module.ENV_BACKEND, "cuda")
    with pytest.raises(ValueError, match=r"^kv-canary: backend 'cuda' needs CUDA tensors, got tensors on cpu$"):
        ask("cpu")
    with pytest.raises(ValueError, match=r"^kv-canary: device must be a torch.device or a device string"):
        ask("not-a-device")


class _Recorder:
    checks_index_values = None  # records launches; makes no index-value checks
    def __init__(self, name: str, calls: list):
        self.name, self.calls = name, calls

    def prepare(self, op: str, args: dict, **_):
        return Prepared(lambda: self.calls.append(self.name), args)


@pytest.mark.parametrize("env", [None, "torch", "emulated"])
@pytest.mark.parametrize("backend", [None, "torch", "emulated"])
def test_use_torch_reference_answers_what_the_launches_do(monkeypatch, env, backend):
    calls: list = []
    monkeypatch.setattr(runtime_module, "get_backend", lambda name, tree: _Recorder(name, calls))
    monkeypatch.setattr(kv_canary.runtime_for(kv_canary.generated), "chosen", {})  # the choices made before
    if env is None:
        monkeypatch.delenv(runtime_module.ENV_BACKEND, raising=False)
    else:
        monkeypatch.setenv(runtime_module.ENV_BACKEND, env)
    case = scenarios.make_scatter_case(random.Random(1), kv_canary.generated, n_reqs=2)
    kv_canary.launch_scatter_req_token_ids_kernel(**case, backend=backend)
    assert kv_canary.use_torch_reference(case["pool_out"].device, backend=backend) == (calls == ["torch"])
