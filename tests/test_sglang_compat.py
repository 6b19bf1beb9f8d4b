"""SGLang parity: calls SGLang accepts that kv-canary handles the same way.

Expected values are written out by hand from small tables (SEMANTICS.md §5.3, §5.4) or from
SGLang's own definitions; they never come from running kv-canary.
"""
from __future__ import annotations

import re
import shutil

import pytest
import torch

import kv_canary

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
HOST_BACKENDS = ["torch", pytest.param("emulated", marks=needs_gxx)]


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


# -- a LUT without a window (issue 9 item 1, SEMANTICS.md §5.3) ---------------------------------------------
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
