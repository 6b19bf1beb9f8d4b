"""What validation refuses besides shapes and dtypes, on every host backend: a tensor whose storage
no longer holds its shape, an input that shares memory with an output, and what a launch may change
of its arguments (its documented outputs' values, nothing else)."""
from __future__ import annotations

import dataclasses
import random

import pytest
import torch
from support import scenarios
from support.launch_kwargs import plan_kwargs, verify_kwargs, write_kwargs

import kv_canary

HOST_BACKENDS = ["torch", "cpu", "emulated"]
P = "kv-canary: "


def _shrunk(t: torch.Tensor) -> torch.Tensor:
    t.untyped_storage().resize_(0)  # the tensor still reports its shape
    return t


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_canary_buffer_whose_storage_was_shrunk_is_refused(backend):
    ctx = kv_canary.allocate_context(num_slots=16, ring_capacity=4, device="cpu")
    _shrunk(ctx.canary_buf)
    assert tuple(ctx.canary_buf.shape) == (16, 32)
    for launch, kwargs in ((kv_canary.launch_canary_write_kernel, write_kwargs(ctx)),
                           (kv_canary.launch_canary_verify_kernel, verify_kwargs(ctx))):
        with pytest.raises(ValueError, match=r"^kv-canary: canary_buf reaches 512 bytes into its storage \(shape "
                                             r"\(16, 32\), .*\), but the storage holds 0 bytes"):
            launch(**kwargs, backend=backend)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("what", ["input_ids", "plan.write_offsets", "ring", "real_kv", "req_to_token", "flat_in"])
def test_every_kind_of_tensor_is_checked_against_its_storage(backend, what):
    src = kv_canary.RealKvSource(tensor=torch.zeros((16, 64), dtype=torch.uint8), page_size=1, num_bytes_per_token=64,
                                 read_bytes=64)
    ctx = kv_canary.allocate_context(num_slots=16, ring_capacity=4, device="cpu", real_kv_sources=(src,),
                                     real_kv_hash_mode=2)
    if what in ("req_to_token", "flat_in"):
        if what == "req_to_token":
            kwargs, launch = plan_kwargs(), kv_canary.launch_canary_plan_kernels
        else:
            kwargs = dict(flat_in=torch.zeros(4, dtype=torch.int64), offsets=torch.tensor([0, 4]),
                          req_pool_indices=torch.tensor([1]), pool_out=torch.zeros((2, 4), dtype=torch.int32))
            launch = kv_canary.scatter_req_token_ids
        _shrunk(kwargs[what])
        name = what
    else:
        kwargs, launch = write_kwargs(ctx), kv_canary.launch_canary_write_kernel
        target = {"input_ids": kwargs["input_ids"], "plan.write_offsets": kwargs["plan"].write_offsets,
                  "ring": ctx.violation_ring, "real_kv": src.tensor}[what]
        _shrunk(target)
        name = {"ring": "violation_ring", "real_kv": "RealKvSource.tensor"}.get(what, what)
    with pytest.raises(ValueError, match=rf"^kv-canary: {name.replace('.', '[.]')} reaches \d+ bytes into its storage"):
        launch(**kwargs, backend=backend)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_an_input_overlapping_an_output_is_refused(backend):
    ctx = kv_canary.allocate_context(num_slots=16, ring_capacity=4, device="cpu")
    words = ctx.canary_buf.view(torch.int64).view(-1)
    with pytest.raises(ValueError, match=r"^kv-canary: out_cache_loc overlaps canary_buf, which this launch writes: "
                                         r"inputs and outputs must not share memory \(pass a copy of out_cache_loc\)$"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(ctx, out_cache_loc=words[:3]), backend=backend)
    kwargs = verify_kwargs(ctx)
    ring = ctx.violation_ring.view(-1)
    plan = dataclasses.replace(kwargs["plan"], verify_slot_indices=ring[:4])
    with pytest.raises(ValueError, match=r"^kv-canary: plan.verify_slot_indices overlaps violation_ring"):
        kv_canary.launch_canary_verify_kernel(**dict(kwargs, plan=plan), backend=backend)
    kwargs = plan_kwargs()
    with pytest.raises(ValueError, match=r"^kv-canary: prefix_lens overlaps write_plan_out.write_offsets"):
        kv_canary.launch_canary_plan_kernels(**dict(kwargs, prefix_lens=kwargs["write_plan_out"].write_offsets[:2]),
                                             backend=backend)
    pool = torch.zeros((2, 4), dtype=torch.int32)
    with pytest.raises(ValueError, match=r"^kv-canary: flat_in overlaps pool_out"):
        kv_canary.scatter_req_token_ids(flat_in=pool.view(torch.int64).view(-1)[:2], offsets=torch.tensor([0, 2]),
                                        req_pool_indices=torch.tensor([1]), pool_out=pool, backend=backend)


def test_a_context_whose_own_tensors_overlap_is_refused_when_built():
    ctx = kv_canary.allocate_context(num_slots=16, ring_capacity=4, device="cpu")
    with pytest.raises(ValueError, match=r"^kv-canary: enable_chain_position_assert overlaps violation_write_index"):
        dataclasses.replace(ctx, enable_chain_position_assert=ctx.violation_write_index)
    src = kv_canary.RealKvSource(tensor=ctx.canary_buf, page_size=1, num_bytes_per_token=32, read_bytes=32)
    with pytest.raises(ValueError, match=r"^kv-canary: real_kv_sources\[0\].tensor overlaps canary_buf"):
        dataclasses.replace(ctx, real_kv_sources=(src,))


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_context_tensor_re_pointed_after_the_context_was_built_is_refused_at_launch(backend):
    """A frozen context checks its own tensors once, when built; `set_` moves a tensor afterwards.
    Every launch checks again what it writes against everything it reads and writes, so the ring
    moved into the canary records is refused on both backends before anything is written."""
    ctx = kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    ctx.violation_ring.set_(ctx.canary_buf.untyped_storage(), 0, (4, 8), (8, 1))
    before = scenarios.clone_case(write_kwargs(ctx))
    case = write_kwargs(ctx)
    with pytest.raises(ValueError, match=r"^kv-canary: violation_ring overlaps canary_buf: this launch writes both, "
                                         r"and its outputs must not share memory \(give each its own tensor\)$"):
        kv_canary.launch_canary_write_kernel(**case, backend=backend)
    scenarios.compare_state(case, before)
    with pytest.raises(ValueError, match=r"^kv-canary: canary_buf overlaps violation_ring, which this launch writes"):
        kv_canary.launch_canary_verify_kernel(**verify_kwargs(ctx), backend=backend)
    ctx = kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    ctx.slot_run_counter.set_(ctx.kernel_run_counter.untyped_storage(), 0, (1,), (1,))
    for launch, kwargs in ((kv_canary.launch_canary_write_kernel, write_kwargs(ctx)),
                           (kv_canary.launch_canary_verify_kernel, verify_kwargs(ctx))):
        with pytest.raises(ValueError, match=r"^kv-canary: (slot|kernel)_run_counter overlaps (slot|kernel)_run_counter: "
                                             r"this launch writes both"):
            launch(**kwargs, backend=backend)
    # A context built from such tensors is refused when built, as before.
    with pytest.raises(ValueError, match=r"^kv-canary: (slot|kernel)_run_counter overlaps (slot|kernel)_run_counter"):
        dataclasses.replace(ctx)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_outputs_sharing_memory_are_refused(backend):
    """Two outputs of one launch in one place: each backend wrote them in its own order ([0, 3, 5]
    on torch, [0, 1, 2] on emulated for the plan's offsets below); every pair must be disjoint."""
    kw = plan_kwargs(swa_window_size=0, full_to_swa_index_mapping=None)
    vplan, wplan = kw["verify_plan_out"], kw["write_plan_out"]
    offsets = dict(req_pool_indices=kw["req_pool_indices"], prefix_lens=kw["prefix_lens"],
                   extend_seq_lens=kw["extend_seq_lens"], req_to_token=kw["req_to_token"],
                   full_to_swa_index_mapping=None, out_verify_offsets_scratch=wplan.write_offsets[:3],
                   out_write_offsets=wplan.write_offsets, out_write_seed_slot_indices=wplan.write_seed_slot_indices,
                   out_verify_num_valid=vplan.verify_num_valid, out_verify_enable=vplan.enable,
                   out_write_num_valid_reqs=wplan.write_num_valid_reqs, swa_window_size=0, verify_capacity=16)
    before = scenarios.clone_case(offsets)
    with pytest.raises(ValueError, match=r"^kv-canary: out_write_offsets overlaps out_verify_offsets_scratch: this "
                                         r"launch writes both, and its outputs must not share memory"):
        kv_canary.launch_plan_offsets_kernel(**offsets, backend=backend)
    scenarios.compare_state(offsets, before)
    # The whole plan: a VerifyPlan array inside the WritePlan's seeds.
    seeds = torch.zeros(16, dtype=torch.int64)
    wplan = dataclasses.replace(wplan, write_seed_slot_indices=seeds[:2])
    vplan = dataclasses.replace(vplan, verify_prev_slot_indices=seeds)
    with pytest.raises(ValueError, match=r"^kv-canary: (verify|write)_plan_out[.]\w+ overlaps (verify|write)_plan_out[.]"
                                         r"\w+: this launch writes both"):
        kv_canary.launch_canary_plan_kernels(**dict(kw, verify_plan_out=vplan, write_plan_out=wplan), backend=backend)
    # A context's outputs: the reason counts inside the ring.
    ctx = kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    with pytest.raises(ValueError, match=r"^kv-canary: violation_reason_counts overlaps violation_ring: this launch "
                                         r"writes both"):
        dataclasses.replace(ctx, violation_reason_counts=ctx.violation_ring.view(-1)[8:15])


def test_views_of_one_storage_that_do_not_overlap_are_fine():
    """Disjoint slices of one allocation (the manager's per-tag kernel-run counters) are not an overlap."""
    counters = torch.zeros(4, dtype=torch.int64)
    ctx = dataclasses.replace(kv_canary.allocate_context(num_slots=16, ring_capacity=4, device="cpu"),
                              kernel_run_counter=counters[1:2], slot_run_counter=counters[2:3])
    kv_canary.launch_canary_verify_kernel(**verify_kwargs(ctx))
    assert counters.tolist() == [0, 1, 0, 0]


def _snapshot(value, path="") -> dict:
    """Every tensor reachable from an argument: (data pointer, shape, strides, dtype, values, resizable)."""
    out = {}
    if isinstance(value, torch.Tensor):
        resizable = value.untyped_storage().resizable()
        out[path] = (value.data_ptr(), tuple(value.shape), value.stride(), value.dtype, value.clone(), resizable)
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            out.update(_snapshot(getattr(value, f.name), f"{path}.{f.name}"))
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            out.update(_snapshot(v, f"{path}[{i}]"))
    elif isinstance(value, dict):
        for k, v in value.items():
            out.update(_snapshot(v, f"{path}.{k}"))
    return out


OUTPUTS = {
    "write": {"context.canary_buf", "context.violation_ring", "context.violation_write_index",
              "context.slot_run_counter", "context.kernel_run_counter", "context.violation_reason_counts"},
    "verify": {"context.violation_ring", "context.violation_write_index", "context.slot_run_counter",
               "context.kernel_run_counter", "context.violation_reason_counts"},
    "plan": {f"verify_plan_out.{n}" for n in ("verify_slot_indices", "verify_expected_tokens", "verify_expected_positions",
                                             "verify_prev_slot_indices", "verify_num_valid", "enable")}
    | {f"write_plan_out.{n}" for n in ("write_offsets", "write_seed_slot_indices", "write_num_valid_reqs")},
    "scatter": {"pool_out"},
}
LAUNCHES = {"write": "launch_canary_write_kernel", "verify": "launch_canary_verify_kernel",
            "plan": "launch_canary_plan_kernels", "scatter": "scatter_req_token_ids"}


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("kind", list(LAUNCHES))
def test_a_launch_changes_nothing_but_its_outputs_values(backend, kind):
    """Storage stays resizable (the reference once read tensors through .numpy(), which pins them),
    addresses, shapes, strides and dtypes stay, and only the documented outputs change values."""
    rt = scenarios.runtime_for(kv_canary.generated)
    make = {"write": scenarios.make_write_case, "verify": scenarios.make_verify_case,
            "plan": scenarios.make_plan_case, "scatter": scenarios.make_scatter_case}[kind]
    case = make(random.Random(11), kv_canary.generated, n_reqs=3)
    before = _snapshot(case)
    getattr(rt, LAUNCHES[kind])(**case, backend=backend)
    after = _snapshot(case)
    assert before.keys() == after.keys()
    for path, (ptr, shape, strides, dtype, values, resizable) in before.items():
        a_ptr, a_shape, a_strides, a_dtype, a_values, a_resizable = after[path]
        assert (a_ptr, a_shape, a_strides, a_dtype) == (ptr, shape, strides, dtype), path
        assert a_resizable == resizable, f"{path}: the launch left its storage non-resizable"
        if path.lstrip(".") not in OUTPUTS[kind]:
            assert torch.equal(a_values, values), f"{path} is not an output of {kind} but changed"
