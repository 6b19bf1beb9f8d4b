"""Bad runtime inputs get a clear error before any launch, identically on every backend, and edge
values that are valid (int64 extremes, a write index near 2**31) run free of undefined behaviour
with the same bytes on the emulated backend as in the torch reference.

`make sanitize` runs this file (and the other bad-input tests) against an ASan+UBSan build of the
emulation library, where any out-of-bounds access or signed overflow aborts the run.
"""
from __future__ import annotations

import dataclasses
import random
import re
import shutil
import subprocess
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from support import launch_kwargs, scenarios
from support.launch_kwargs import verify_kwargs, write_kwargs

import kv_canary
from kv_canary.trees.emulation_build import sanitize_enabled
from kv_canary.trees.sources import kernel_abi

P = "kv-canary: "
_NEEDS_GXX = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
HOST_BACKENDS = ["torch", pytest.param("cpu", marks=_NEEDS_GXX), pytest.param("emulated", marks=_NEEDS_GXX)]
needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
INT_MAX, INT64_MAX, INT64_MIN = 2**31 - 1, 2**63 - 1, -(2**63)


def raises(exc, text):
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


def rt():
    return scenarios.runtime_for(kv_canary.generated)


def plan_kwargs(**over):
    """A full-attention plan (no window, no LUT) with expected tokens."""
    return launch_kwargs.plan_kwargs(**{"swa_window_size": 0, "full_to_swa_index_mapping": None,
                                        "req_to_verify_expected_tokens": torch.arange(12, dtype=torch.int32).view(3, 4),
                                        "req_to_verify_expected_tokens_valid_lens": torch.tensor([4, 4]), **over})


@pytest.mark.skipif(not sanitize_enabled(), reason="only under `make sanitize` (KV_CANARY_EMULATION_SANITIZE=1)")
def test_make_sanitize_runs_the_instrumented_library():
    for backend in ("emulated", "cpu"):
        path = kv_canary.runtime_for(kv_canary.generated).backend(backend).library.path
        symbols = subprocess.run(["nm", "-D", str(path)], capture_output=True, text=True, check=True).stdout
        assert "asan_ubsan" in path.name and "__asan_report_" in symbols and "__ubsan_handle_" in symbols, path


# -- 1. scalars that do not fit the kernels' C types --------------------------------------------------
def test_the_ranges_come_from_the_kernel_abi():
    """ARGUMENT_KINDS is rendered from the parameter list: each real-KV field has the C type of its
    kernel parameter, and each capacity the element type of the int* its count is stored in."""
    abi = kernel_abi(kv_canary.generated)
    kinds = {"int": "i32", "long long": "i64"}
    verify = abi.kernel_for_operation("verify")
    params = {p.name: p.ctype for p in verify.params}
    for field in ("page_size", "num_bytes_per_token", "read_bytes"):
        assert abi.ARGUMENT_KINDS["RealKvSource." + field] == kinds[params[f"real_kv_{field}_0"]]
    plan_offsets = {p.name: p.ctype for p in abi.kernel_for_operation("plan_offsets").params}
    assert plan_offsets["verify_num_valid"] == "int*" and abi.ARGUMENT_KINDS["verify_capacity"] == "i32"
    assert plan_offsets["write_num_valid_reqs"] == "int*" and abi.ARGUMENT_KINDS["write_req_capacity"] == "i32"
    assert params["violation_write_index"] == "int*" and abi.ARGUMENT_KINDS["ring_capacity"] == "i32"
    entries = {p.name: p.ctype for p in abi.kernel_for_operation("plan_entries").params}
    for name in ("swa_window_size", "kv_token_id_vs_position_offset"):
        assert abi.ARGUMENT_KINDS[name] == kinds[entries[name]]


@pytest.mark.parametrize("field, value, text", [
    ("num_bytes_per_token", 2**31 + 16, "<= 2**31-1 = 2147483647 (the kernels hold it in a C int), got 2147483664"),
    ("page_size", 2**40, "<= 2**31-1 = 2147483647 (the kernels hold it in a C int), got 1099511627776"),
])
def test_real_kv_source_fields_must_fit_a_c_int(field, value, text):
    """A 2 GiB num_bytes_per_token used to reach the kernels as a C int (the emulated verify then read
    2 GiB before the row); the source is refused when it is built."""
    kw = dict(tensor=torch.zeros((4, 64), dtype=torch.uint8), page_size=1, num_bytes_per_token=32, read_bytes=16)
    kw[field] = value
    with raises(ValueError, P + f"RealKvSource.{field} must be " + text):
        kv_canary.RealKvSource(**kw)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_source_assembled_by_hand_is_refused_at_launch(backend):
    ctx = kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu", real_kv_hash_mode=2)
    bad = SimpleNamespace(tensor=torch.zeros((4, 64), dtype=torch.uint8), page_size=1, num_bytes_per_token=2**31 + 16,
                          read_bytes=16)
    with raises(ValueError, P + "RealKvSource.num_bytes_per_token must be <= 2**31-1 = 2147483647 (the kernels hold "
                                "it in a C int), got 2147483664"):
        rt().launch_canary_verify_kernel(**verify_kwargs(dataclasses.replace(ctx, real_kv_sources=(bad,))),
                                         backend=backend)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
@pytest.mark.parametrize("name, value, text", [
    ("kv_token_id_vs_position_offset", 2**64 + 1, "<= 2**63-1 = 9223372036854775807 (the kernels hold it in a C long "
                                                  "long), got 18446744073709551617"),
    ("kv_token_id_vs_position_offset", INT64_MIN - 1, ">= -2**63 = -9223372036854775808 (the kernels hold it in a C "
                                                      "long long), got -9223372036854775809"),
    ("swa_window_size", 2**63, "<= 2**63-1 = 9223372036854775807 (the kernels hold it in a C long long), "
                               "got 9223372036854775808"),
])
def test_plan_scalars_must_fit_their_c_type_on_every_backend(backend, name, value, text):
    """2**64 + 1 ran as 1 on emulated and raised OverflowError on torch: now one ValueError for both."""
    kw = plan_kwargs(**{name: value})
    if name == "swa_window_size":
        kw["full_to_swa_index_mapping"] = torch.arange(20)
    before = scenarios.clone_case(kw)
    with raises(ValueError, P + f"{name} must be " + text):
        kv_canary.launch_canary_plan_kernels(**kw, backend=backend)
    scenarios.compare_state(kw, before)


@pytest.mark.parametrize("make, text", [
    (lambda: kv_canary.VerifyPlan.allocate(verify_capacity=2**31, device="cpu"),
     "verify_capacity must be <= 2**31-1 = 2147483647 (the kernels hold it in a C int), got 2147483648"),
    (lambda: kv_canary.WritePlan.allocate(write_req_capacity=2**62, device="cpu"),
     "write_req_capacity must be <= 2**31-1 = 2147483647 (the kernels hold it in a C int), got 4611686018427387904"),
    (lambda: kv_canary.allocate_violation_ring(2**62, device="cpu"),
     "ring_capacity must be <= 2**31-1 = 2147483647 (the kernels hold it in a C int), got 4611686018427387904"),
    (lambda: kv_canary.allocate_canary_buf(2**62, device="cpu"),
     "canary_buf is too large: num_slots=4611686018427387904 x slot_stride_bytes=32 = 147573952589676412928 bytes, "
     "more than a signed 64-bit integer holds (2**63-1 = 9223372036854775807); the kernels compute it in one"),
])
def test_huge_capacities_are_refused_before_allocating(make, text):
    with raises(ValueError, P + text):
        make()


@pytest.mark.parametrize("helper, args, exc, text", [
    ("canary_buf_bytes", (-1,), ValueError, "num_slots must be >= 0, got -1"),
    ("canary_buf_bytes", ("8",), TypeError, "num_slots must be an int, got str"),
    ("canary_buf_bytes", (8, 12), ValueError, "canary_buf slot stride must be a multiple of 8 bytes, got 12 (shape (8, 12))"),
    ("canary_buf_bytes", (2**62,), ValueError,
     "canary_buf is too large: num_slots=4611686018427387904 x slot_stride_bytes=32 = 147573952589676412928 bytes, "
     "more than a signed 64-bit integer holds (2**63-1 = 9223372036854775807); the kernels compute it in one"),
    ("violation_ring_bytes", (None,), TypeError, "ring_capacity must be an int, got NoneType"),
    ("violation_ring_bytes", (-3,), ValueError, "ring_capacity must be >= 0, got -3"),
    ("violation_ring_bytes", (2**31,), ValueError,
     "ring_capacity must be <= 2**31-1 = 2147483647 (the kernels hold it in a C int), got 2147483648"),
])
def test_the_size_helpers_check_their_sizes_as_the_allocators_do(helper, args, exc, text):
    """canary_buf_bytes(-1) was -32 and canary_buf_bytes('8') a 32-character string: each helper now
    refuses what its allocator refuses, with the allocator's text."""
    allocators = kv_canary.runtime_for(kv_canary.generated).allocators
    allocate = {"canary_buf_bytes": lambda n, *stride: allocators.allocate_canary_buf(
                    n, device="cpu", **dict(zip(["slot_stride_bytes"], stride))),
                "violation_ring_bytes": lambda *a: allocators.allocate_violation_ring(*a, device="cpu")}[helper]
    with raises(exc, P + text):
        getattr(allocators, helper)(*args)
    with raises(exc, P + text):
        allocate(*args)


@pytest.mark.parametrize("n", [2**63 // 8, 2**70])
def test_run_counters_past_what_torch_can_count_are_a_clear_error(n):
    """2**70 counters reached torch.zeros, whose TypeError named none of kv-canary's arguments."""
    counters = kv_canary.runtime_for(kv_canary.generated).allocators.allocate_counters
    with raises(ValueError, P + f"n must be <= {2**63 // 8 - 1} (n int64 counters of 8 bytes each, counted in a "
                                f"signed 64-bit integer), got {n}"):
        counters(n, device="cpu")


def test_an_allocation_the_device_cannot_hold_is_a_clear_error():
    with pytest.raises(ValueError, match=r"^kv-canary: cannot allocate canary_buf of 1125899906842624 slots "
                                         r"\(36028797018963968 bytes\) on cpu: .+"):
        kv_canary.allocate_canary_buf(2**50, device="cpu")
    counters = kv_canary.runtime_for(kv_canary.generated).allocators.allocate_counters
    with pytest.raises(ValueError, match=r"^kv-canary: cannot allocate 1125899906842624 run counters "
                                         r"\(9007199254740992 bytes\) on cpu: .+"):
        counters(2**50, device="cpu")


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_the_verify_plan_total_must_fit_int64(backend):
    """bs x columns bounds the verify entries the plan kernel sums; an empty [0, 2**62] table has them."""
    kw = plan_kwargs(req_to_token=torch.empty((0, 2**62), dtype=torch.int32), req_pool_indices=torch.tensor([0, 0]),
                     req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None)
    with raises(ValueError, P + "the verify plan is too large: requests=2 x req_to_token columns=4611686018427387904 = "
                                "9223372036854775808 entries at most, more than a signed 64-bit integer holds "
                                "(2**63-1 = 9223372036854775807); the kernels compute it in one"):
        kv_canary.launch_canary_plan_kernels(**kw, backend=backend)


# -- 2. alignment -------------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_misaligned_canary_buf_is_refused(backend):
    raw = torch.zeros(8 * 32 + 1, dtype=torch.uint8)
    ctx = dataclasses.replace(kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu"),
                              canary_buf=raw[1:].view(8, 32))
    msg = (P + f"canary_buf data must be 8-byte aligned (the kernels read it as 8-byte record words), got address "
           f"{raw.data_ptr() + 1:#x} (storage offset 1 elements)")
    with raises(ValueError, msg):
        kv_canary.launch_canary_verify_kernel(**verify_kwargs(ctx), backend=backend)
    with raises(ValueError, msg):
        kv_canary.launch_canary_write_kernel(**write_kwargs(ctx), backend=backend)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_misaligned_int64_tensor_is_refused(backend):
    """torch.from_numpy takes an unaligned numpy buffer as it is; the kernels would read int64s at an
    odd address."""
    array = np.frombuffer(bytearray(8 * 3 + 1), dtype=np.int64, count=3, offset=1)
    positions = torch.from_numpy(array)
    with raises(ValueError, P + f"positions data must be 8-byte aligned (the kernels read it as its torch.int64 "
                                f"elements), got address {positions.data_ptr():#x} (storage offset 0 elements)"):
        kv_canary.launch_canary_write_kernel(**write_kwargs(positions=positions), backend=backend)


# -- 5. smaller items ---------------------------------------------------------------------------------
@pytest.mark.parametrize("backend", [*HOST_BACKENDS, None])
def test_meta_tensors_are_refused(backend):
    ctx = kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="meta")
    plan = kv_canary.VerifyPlan.allocate(verify_capacity=4, device="meta")
    with raises(ValueError, P + "canary_buf is on the meta device, which holds no data; kv-canary launches need "
                                "tensors with memory (e.g. on cpu or cuda)"):
        kv_canary.launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=False,
                                              backend=backend)
    with raises(ValueError, P + "RealKvSource.tensor is on the meta device, which holds no data; kv-canary launches "
                                "need tensors with memory (e.g. on cpu or cuda)"):
        kv_canary.RealKvSource(tensor=torch.zeros((4, 64), dtype=torch.uint8, device="meta"), page_size=1,
                               num_bytes_per_token=32, read_bytes=16)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_req_to_token_without_columns_is_refused(backend):
    """It has no column for any request's seed; the torch reference raised IndexError, the kernels
    marked every seed unreadable."""
    kw = plan_kwargs(req_to_token=torch.zeros((3, 0), dtype=torch.int32))
    with raises(ValueError, P + "req_to_token must have at least 1 column (one per context position), got shape (3, 0)"):
        kv_canary.launch_canary_plan_kernels(**kw, backend=backend)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this torch can allocate on CUDA")
def test_cuda_allocation_without_cuda_is_a_clear_error():
    why = "this torch build has no CUDA support" if torch.version.cuda is None else "torch sees no CUDA device"
    for make in (lambda: kv_canary.VerifyPlan.allocate(verify_capacity=4, device="cuda"),
                 lambda: kv_canary.WritePlan.allocate(write_req_capacity=4, device="cuda:0"),
                 lambda: kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cuda")):
        with pytest.raises(ValueError, match=rf"^kv-canary: device is 'cuda(:0)?', but {why}; allocate on 'cpu' instead$"):
            make()


def test_allocate_context_checks_its_real_kv_sources():
    with raises(TypeError, P + "real_kv_sources must be a tuple of RealKvSource, got str"):
        kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu", real_kv_sources="ab")
    with raises(TypeError, P + "real_kv_sources[0] must be a RealKvSource, got int"):
        kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu", real_kv_sources=(1,))
    bad = SimpleNamespace(tensor=torch.zeros((4, 64), dtype=torch.uint8), page_size=0, num_bytes_per_token=32,
                          read_bytes=16)
    with raises(ValueError, P + "RealKvSource.page_size must be >= 1, got 0"):
        kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="cpu", real_kv_sources=(bad,))
    src = kv_canary.RealKvSource(tensor=torch.zeros((4, 64), dtype=torch.uint8), page_size=1, num_bytes_per_token=32,
                                 read_bytes=16)
    with raises(ValueError, P + "real_kv_sources[0].tensor must be on meta (the device of canary_buf), got cpu"):
        kv_canary.allocate_context(num_slots=4, ring_capacity=4, device="meta", real_kv_sources=(src,))


def test_capacities_take_numpy_integers_like_every_other_size():
    plan = kv_canary.VerifyPlan.allocate(verify_capacity=np.int64(4), device="cpu")
    wplan = kv_canary.WritePlan.allocate(write_req_capacity=np.int32(2), device="cpu")
    assert plan.verify_slot_indices.shape == (4,) and wplan.write_seed_slot_indices.shape == (2,)
    assert kv_canary.VerifyPlan.allocation_bytes(np.int16(4)) == kv_canary.VerifyPlan.allocation_bytes(4)
    kv_canary.launch_canary_plan_kernels(**plan_kwargs(verify_plan_out=plan, write_plan_out=wplan,
                                                       verify_capacity=np.int64(4)))
    with raises(TypeError, P + "verify_capacity must be an int, got bool"):
        kv_canary.VerifyPlan.allocate(verify_capacity=True, device="cpu")


@needs_gxx
@pytest.mark.parametrize("ring_capacity", [64, 5])
def test_emulated_verify_rows_come_in_entry_order(ring_capacity):
    """Out-of-range entries (rows from the first half of an entry's check) mixed with mismatching ones
    (rows from the second half, after the warp's cooperative real-KV loads), over more entries than
    the emulated grid has threads: the ring equals the reference's row for row, also when it overflows."""
    tree = kv_canary.generated
    rng = random.Random(7)
    num_slots = 40
    sources = scenarios.make_sources(rng, tree, num_slots, count=2)
    ctx = kv_canary.allocate_context(num_slots=num_slots, ring_capacity=ring_capacity, device="cpu",
                                     real_kv_sources=sources, real_kv_hash_mode=kv_canary.RealKvHashMode.ALL)
    n = 300
    plan = kv_canary.VerifyPlan.allocate(verify_capacity=n, device="cpu")
    slots = [num_slots + e if e % 3 == 0 else 1 + e % (num_slots - 1) for e in range(n)]
    plan.verify_slot_indices.copy_(torch.tensor(slots))
    plan.verify_prev_slot_indices.fill_(-1)
    plan.verify_expected_positions.copy_(torch.arange(n))
    plan.verify_num_valid.fill_(n)
    case = dict(context=ctx, plan=plan, check_verify_expected_token=False)
    got, want = scenarios.clone_case(case), scenarios.clone_case(case)
    native = scenarios.clone_case(case)
    kv_canary.launch_canary_verify_kernel(**got, backend="emulated")
    kv_canary.launch_canary_verify_kernel(**native, backend="cpu")
    kv_canary.launch_canary_verify_kernel(**want, backend="torch")
    assert int(want["context"].violation_write_index[0]) == n  # every entry produced one row
    scenarios.compare_state(got, want)
    scenarios.compare_state(native, want)


# -- 3. edge values that are valid: no undefined behaviour, the reference's bytes ---------------------
def _same_on_emulated(kind: str, case: dict) -> None:
    from support.kernel_diff import compare
    compare(kv_canary.generated, kind, case, "emulated", ordered=True)
    compare(kv_canary.generated, kind, case, "cpu", ordered=True)  # the native kernels too


@needs_gxx
def test_write_offsets_wrap_like_the_reference():
    """extend lengths summing past int64: the plan's prefix sum wraps (unsigned in the kernel)."""
    case = scenarios.make_plan_case(random.Random(3), kv_canary.generated, n_reqs=3)
    case["extend_seq_lens"].copy_(torch.tensor([2**62, 2**62, INT64_MAX]))
    case["prefix_lens"].copy_(torch.tensor([1, 1, 1]))
    _same_on_emulated("plan", case)


@needs_gxx
@pytest.mark.parametrize("offset", [INT64_MAX, INT64_MIN, INT64_MAX - 1, -5])
def test_extreme_token_offsets_read_nothing_and_wrap_like_the_reference(offset):
    case = scenarios.make_plan_case(random.Random(5), kv_canary.generated, n_reqs=4)
    if case.get("req_to_verify_expected_tokens") is None:
        rows, cols = case["req_to_token"].shape
        case["req_to_verify_expected_tokens"] = torch.arange(rows * cols, dtype=torch.int32).view(rows, cols)
        case["req_to_verify_expected_tokens_valid_lens"] = torch.full((4,), cols, dtype=torch.int64)
    case["kv_token_id_vs_position_offset"] = offset
    _same_on_emulated("plan", case)


@needs_gxx
def test_a_seed_at_the_largest_position_wraps_the_position_assert():
    """prev_pos + 1 for a stored INT64_MAX: the expected position wraps to INT64_MIN (a row), no UB."""
    tree = kv_canary.generated
    ctx = kv_canary.allocate_context(num_slots=8, ring_capacity=8, device="cpu")
    ctx.canary_buf.view(torch.int64)[3, tree.layout.CANARY_POSITION_WORD] = INT64_MAX
    plan = kv_canary.WritePlan.allocate(write_req_capacity=1, device="cpu")
    plan.write_offsets.copy_(torch.tensor([0, 2]))
    plan.write_seed_slot_indices.fill_(3)
    plan.write_num_valid_reqs.fill_(1)
    case = dict(context=ctx, plan=plan, input_ids=torch.tensor([5, 6]), positions=torch.tensor([INT64_MIN, 7]),
                out_cache_loc=torch.tensor([4, 5]), enable_write_input_assert=False, expected_input_tokens=None,
                expected_input_positions=None)
    _same_on_emulated("write", case)
    kv_canary.launch_canary_write_kernel(**case, backend="torch")
    rows = case["context"].violation_ring[: int(case["context"].violation_write_index[0])]
    assert rows[:, tree.layout.VIOLATION_COL_EXPECTED_AUX].tolist() == [INT64_MIN + 1]   # entry 2: 7 != MIN + 1


@needs_gxx
@pytest.mark.parametrize("kind", ["verify", "write"])
def test_the_write_index_wraps_past_int_max_like_atomic_add(kind):
    """violation_write_index is an int32 that keeps counting: from 2**31-2 it wraps to -2**31 (rows
    past the wrap are dropped), in the emulation's atomicAdd as on a GPU and in the reference."""
    rng = random.Random(11)
    for seed in range(6):
        case = (scenarios.make_verify_case if kind == "verify" else scenarios.make_write_case)(
            random.Random(seed), kv_canary.generated)
        case["context"].violation_write_index.fill_(INT_MAX - rng.randrange(3))
        _same_on_emulated(kind, case)
