"""SGLang parity (docs/sglang-compat.md): calls SGLang accepts that kv-canary handles the same way,
and the deviations of the ledger that no other test pins.

Expected values are written out by hand from small tables (docs/semantics.md §5.3, §5.4) or from
SGLang's own definitions; they never come from running kv-canary.
"""
from __future__ import annotations

import dataclasses
import inspect
import re
import shutil

import numpy as np
import pytest
import torch

import kv_canary

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
HOST_BACKENDS = ["torch", pytest.param("cpu", marks=needs_gxx), pytest.param("emulated", marks=needs_gxx)]


def raises(exc, text):
    return pytest.raises(exc, match="^" + re.escape(text) + "$")


def plan(backend, *, r2t, rows, prefixes, extends, window=0, lut=None, capacity=8, write_capacity=None,
         launch=None, **extra):
    """One plan launch on fresh plans; returns (verify plan, write plan)."""
    vp = kv_canary.VerifyPlan.allocate(verify_capacity=capacity, device="cpu")
    wp = kv_canary.WritePlan.allocate(write_req_capacity=write_capacity or max(len(rows), 1), device="cpu")
    kw = dict(verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor(rows, dtype=torch.int64),
              prefix_lens=torch.tensor(prefixes, dtype=torch.int64), extend_seq_lens=torch.tensor(extends, dtype=torch.int64),
              req_to_token=torch.tensor(r2t, dtype=torch.int32), swa_window_size=window, full_to_swa_index_mapping=lut,
              verify_capacity=capacity, **extra)
    if launch is None:
        kv_canary.launch_canary_plan_kernels(**kw, backend=backend)
    else:
        launch(**kw)
    return vp, wp


def entries(vp) -> dict:
    n = int(vp.verify_num_valid[0])
    return {"enable": int(vp.enable[0]), "slots": vp.verify_slot_indices[:n].tolist(),
            "prevs": vp.verify_prev_slot_indices[:n].tolist(), "positions": vp.verify_expected_positions[:n].tolist(),
            "tokens": vp.verify_expected_tokens[:n].tolist()}


def writes(wp, bs: int) -> dict:
    return {"offsets": wp.write_offsets[: bs + 1].tolist(), "seeds": wp.write_seed_slot_indices[:bs].tolist(),
            "reqs": int(wp.write_num_valid_reqs[0])}


# -- a LUT without a window (docs/semantics.md §5.3) ---------------------------------------------
# Row 0 is the padding row; full-pool slots in rows 1 and 2 (-1 passes through any translation).
R2T = [[0, 0, 0, 0], [3, 5, 7, 9], [2, -1, 6, 8]]
LUT = torch.tensor([0, 90, 81, 72, 63, 54, 45, 36, 27, 18], dtype=torch.int64)   # full slot s -> LUT[s]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_lut_without_a_window_translates_seeds_slots_and_predecessors(backend):
    # Request 0: row 1, prefix 3, one new token; request 1: row 2, prefix 2, two new tokens.
    kw = dict(r2t=R2T, rows=[1, 2], prefixes=[3, 2], extends=[1, 2], window=0)
    vp, wp = plan(backend, lut=LUT, **kw)
    assert entries(vp) == {"enable": 1,
                           "slots": [72, 54, 36, 81, -1],        # LUT[3], LUT[5], LUT[7] | LUT[2], -1
                           "prevs": [-1, 72, 54, -1, 81],         # the chain head, then the translated predecessor
                           "positions": [0, 1, 2, 0, 1], "tokens": [-1] * 5}
    # Seeds: LUT[req_to_token[1, 2]] = LUT[7]; request 1's seed req_to_token[2, 1] = -1 passes through.
    assert writes(wp, 2) == {"offsets": [0, 1, 3], "seeds": [36, -1], "reqs": 2}
    # The same batch without a LUT keeps the full-pool slots: the translation above is the LUT's.
    vp, wp = plan(backend, lut=None, **kw)
    assert entries(vp)["slots"] == [3, 5, 7, 2, -1] and writes(wp, 2)["seeds"] == [7, -1]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_lut_without_a_window_rejects_an_index_past_the_lut(backend):
    """§7's text on both host backends, naming the first index the plan reads: the seed, then the
    entries' slots; nothing is written, and an overflowing verify plan reads no entry at all."""
    short = torch.arange(6, dtype=torch.int64) * 10              # indices 0..5
    r2t = [[0, 0, 0, 0], [8, 2, 9, 0]]                           # 8 and 9 lie past it; the seed would be 9
    for extend, first in ((1, 9), (0, 8)):
        vp = kv_canary.VerifyPlan.allocate(verify_capacity=8, device="cpu")
        wp = kv_canary.WritePlan.allocate(write_req_capacity=1, device="cpu")
        with raises(ValueError, f"kv-canary: SWA slot {first} is outside full_to_swa_index_mapping length 6"):
            kv_canary.launch_canary_plan_kernels(
                verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor([1]), prefix_lens=torch.tensor([3]),
                extend_seq_lens=torch.tensor([extend]), req_to_token=torch.tensor(r2t, dtype=torch.int32),
                swa_window_size=0, full_to_swa_index_mapping=short, verify_capacity=8, backend=backend)
        assert entries(vp)["enable"] == 1 and vp.verify_num_valid.item() == 0     # as allocated
        assert wp.write_num_valid_reqs.item() == 0 and wp.write_seed_slot_indices.tolist() == [-1]
    vp, wp = plan(backend, r2t=r2t, rows=[1], prefixes=[3], extends=[0], lut=short, capacity=2)
    assert vp.enable.item() == 0 and vp.verify_num_valid.item() == 2


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_negative_window_is_full_attention(backend):
    """SGLang's rule (`window_start = max(0, prefix - W) if W > 0 else 0`): a window <= 0 verifies the
    whole prefix and, like 0, needs no LUT."""
    kw = dict(r2t=R2T, rows=[1, 2], prefixes=[3, 2], extends=[1, 2])
    for lut in (LUT, None):
        got = plan(backend, window=-3, lut=lut, **kw)
        want = plan(backend, window=0, lut=lut, **kw)
        assert entries(got[0]) == entries(want[0]) and writes(got[1], 2) == writes(want[1], 2)
        assert len(entries(got[0])["slots"]) == 5


def test_numpy_integer_capacities_and_window():
    vp = kv_canary.VerifyPlan.allocate(verify_capacity=np.int64(8), device="cpu")
    wp = kv_canary.WritePlan.allocate(write_req_capacity=np.int32(2), device="cpu")
    assert vp.verify_slot_indices.shape == (8,) and wp.write_offsets.shape == (3,)
    kv_canary.launch_canary_plan_kernels(
        verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor([1, 2]), prefix_lens=torch.tensor([3, 2]),
        extend_seq_lens=torch.tensor([1, 2]), req_to_token=torch.tensor(R2T, dtype=torch.int32),
        swa_window_size=np.int32(0), full_to_swa_index_mapping=LUT, verify_capacity=np.int64(8))
    assert entries(vp)["slots"] == [72, 54, 36, 81, -1]
    with raises(TypeError, "kv-canary: verify_capacity must be an int, got bool"):
        kv_canary.VerifyPlan.allocate(verify_capacity=True, device="cpu")


# -- names SGLang exposes (its launch and helper names: tests/launch/test_sglang_names.py) ----------------------
def test_canary_slot_bytes_is_sglangs_record_size():
    assert kv_canary.CANARY_SLOT_BYTES == kv_canary.CANARY_FIELDS_PER_SLOT * 8   # SGLang: fields x 8 bytes


def test_allocation_bytes_follow_sglangs_formulas():
    for cap in (0, 1, 7):   # SGLang: 4 int64 arrays + 2 int32 scalars; 2 * cap + 1 int64 + 1 int32
        assert kv_canary.VerifyPlan.allocation_bytes(cap) == 4 * cap * 8 + 2 * 4
        assert kv_canary.WritePlan.allocation_bytes(cap) == (2 * cap + 1) * 8 + 4
    with raises(ValueError, "kv-canary: verify_capacity must be >= 0, got -1"):
        kv_canary.VerifyPlan.allocation_bytes(-1)
    with raises(ValueError, "kv-canary: write_req_capacity must be >= 0, got -2"):
        kv_canary.WritePlan.allocation_bytes(-2)


def test_sglangs_required_keywords_have_defaults():
    """[extension] SGLang requires every keyword; kv-canary defaults the optional inputs."""
    def defaults(func, names):
        params = inspect.signature(func).parameters
        return [params[n].default for n in names]

    assert defaults(kv_canary.launch_canary_write_kernel, ["expected_input_tokens", "expected_input_positions"]) == [None, None]
    assert defaults(kv_canary.launch_canary_plan_kernels, [
        "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens",
        "kv_token_id_vs_position_offset"]) == [None, None, 0]
    fields = {f.name: f.default for f in dataclasses.fields(kv_canary.VerifyOrWriteContext)}
    assert fields["real_kv_sources"] == () and fields["real_kv_hash_mode"] == kv_canary.RealKvHashMode.NONE


# -- refusals and bounds of the ledger ------------------------------------------------------------------------
def test_plan_refuses_more_requests_than_the_write_capacity():
    """SGLang's reference silently leaves requests past the capacity without seed and range."""
    text = "kv-canary: req_pool_indices holds 3 requests but write_plan_out.write_req_capacity is 2"
    for launch in (kv_canary.launch_canary_plan_kernels, kv_canary.launch_canary_plan_kernels_torch_reference):
        with raises(ValueError, text):
            plan(None, r2t=R2T, rows=[1, 2, 1], prefixes=[1, 1, 1], extends=[1, 1, 1], write_capacity=2, launch=launch)


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_valid_lens_without_a_pool_are_ignored(backend):
    """As in SGLang: its runtime passes the valid lens on every forward, with or without the pool (the
    default configuration has none), and the plan then gives every entry the expected token -1."""
    r2t = [[0, 0, 0, 0], [3, 5, 7, 9]]
    alone = plan(backend, r2t=r2t, rows=[1], prefixes=[3], extends=[1], req_to_verify_expected_tokens=None,
                 req_to_verify_expected_tokens_valid_lens=torch.tensor([2]))
    neither = plan(backend, r2t=r2t, rows=[1], prefixes=[3], extends=[1])
    assert entries(alone[0]) == entries(neither[0]) == {"enable": 1, "slots": [3, 5, 7], "prevs": [-1, 3, 5],
                                                        "positions": [0, 1, 2], "tokens": [-1, -1, -1]}
    assert writes(alone[1], 1) == writes(neither[1], 1) == {"offsets": [0, 1], "seeds": [7], "reqs": 1}


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_plan_reads_stay_inside_req_to_token_and_the_pool(backend):
    """A prefix longer than req_to_token's rows is clamped to them; expected tokens are read only inside
    the pool (SGLang's reference raises IndexError here, its CUDA kernels read past the rows)."""
    pool = torch.tensor([[0, 0, 0], [101, 102, 103]], dtype=torch.int32)   # rows 0-1 only, 3 columns
    vp, wp = plan(backend, r2t=[[0, 0, 0, 0], [3, 5, 7, 9], [2, 4, 6, 8]], rows=[1, 2], prefixes=[9, 2],
                  extends=[1, 0], capacity=8, req_to_verify_expected_tokens=pool,
                  req_to_verify_expected_tokens_valid_lens=torch.tensor([10, 10]))
    assert entries(vp) == {"enable": 1, "slots": [3, 5, 7, 9, 2, 4], "prevs": [-1, 3, 5, 7, -1, 2],
                           "positions": [0, 1, 2, 3, 0, 1], "tokens": [101, 102, 103, -1, -1, -1]}
    assert writes(wp, 2) == {"offsets": [0, 1, 1], "seeds": [9, -1], "reqs": 2}


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_plan_takes_more_than_4096_requests(backend):
    """[extension] SGLang's Triton offsets kernel stops at 4096 requests per launch."""
    bs = 4097
    vp, wp = plan(backend, r2t=[[0, 0], [5, 6]], rows=[1] * bs, prefixes=[1] * bs, extends=[1] * bs, capacity=bs)
    assert entries(vp) == {"enable": 1, "slots": [5] * bs, "prevs": [-1] * bs, "positions": [0] * bs,
                           "tokens": [-1] * bs}
    assert writes(wp, bs) == {"offsets": list(range(bs + 1)), "seeds": [5] * bs, "reqs": bs}


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_scatter_takes_more_than_511_requests(backend):
    """[extension] SGLang 0.5.23's scatter refuses bs + 1 > 512 (one Triton tile scans the offsets)."""
    bs = 600
    pool = torch.full((bs + 1, 3), -7, dtype=torch.int32)
    kv_canary.launch_scatter_req_token_ids_kernel(
        flat_in=torch.arange(2 * bs, dtype=torch.int64), offsets=torch.arange(0, 2 * bs + 1, 2, dtype=torch.int64),
        req_pool_indices=torch.arange(1, bs + 1, dtype=torch.int64), pool_out=pool, backend=backend)
    assert pool[0].tolist() == [-7, -7, -7]
    assert pool[1:].tolist() == [[2 * r, 2 * r + 1, -7] for r in range(bs)]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_scatter_into_a_pool_with_padded_rows(backend):
    """SGLang's scatter steps pool rows by stride(0): a view of the first columns of a wider tensor works."""
    base = torch.full((3, 10), -7, dtype=torch.int32)
    pool = base[:, :6]
    kv_canary.scatter_req_token_ids(flat_in=torch.arange(11, 19), offsets=torch.tensor([0, 3, 8]),
                                    req_pool_indices=torch.tensor([2, 0]), pool_out=pool, backend=backend)
    assert base.tolist() == [[14, 15, 16, 17, 18, -7] + [-7] * 4, [-7] * 10, [11, 12, 13, -7, -7, -7] + [-7] * 4]


def test_scatter_refuses_strides_sglang_would_misread():
    """SGLang's Triton scatter ignores every stride but pool_out's row stride: it would read and write
    the wrong elements of these, silently."""
    kw = dict(flat_in=torch.arange(4), offsets=torch.tensor([0, 4]), req_pool_indices=torch.tensor([0]))
    columns_strided = torch.zeros((6, 4), dtype=torch.int32).t()                   # shape (4, 6), strides (1, 4)
    with raises(ValueError, "kv-canary: pool_out rows must be contiguous and must not overlap (stride(1) == 1 and "
                            "stride(0) >= 6), got shape (4, 6) and strides (1, 4)"):
        kv_canary.scatter_req_token_ids(**kw, pool_out=columns_strided)
    overlapping = torch.zeros(8, dtype=torch.int32).as_strided((3, 6), (1, 1))
    with raises(ValueError, "kv-canary: pool_out rows must be contiguous and must not overlap (stride(1) == 1 and "
                            "stride(0) >= 6), got shape (3, 6) and strides (1, 1)"):
        kv_canary.scatter_req_token_ids(**kw, pool_out=overlapping)
    with raises(ValueError, "kv-canary: flat_in must be contiguous"):
        kv_canary.scatter_req_token_ids(**{**kw, "flat_in": torch.arange(8)[::2]},
                                        pool_out=torch.zeros((1, 6), dtype=torch.int32))


def test_real_kv_source_is_checked_when_built():
    """SGLang checks a source's row width only when its torch reference launches, and its alignment
    never (the CUDA kernels' 16-byte loads fault); kv-canary refuses both at construction."""
    raw = torch.zeros(4 * 64 + 16, dtype=torch.uint8)
    misaligned = raw[8: 8 + 4 * 64].view(4, 64)
    with pytest.raises(ValueError, match=r"^kv-canary: RealKvSource.tensor data must be 16-byte aligned"):
        kv_canary.RealKvSource(tensor=misaligned, page_size=1, num_bytes_per_token=64, read_bytes=16)
    with raises(ValueError, "kv-canary: RealKvSource row is too narrow for its slot layout: dim-1 is 64 bytes but "
                            "page_size=2 x num_bytes_per_token=64 needs 128"):
        kv_canary.RealKvSource(tensor=raw[: 4 * 64].view(4, 64), page_size=2, num_bytes_per_token=64, read_bytes=16)
