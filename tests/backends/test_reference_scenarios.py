"""Sentinels (docs/semantics.md §5) and corruption scenarios: which bit fires on which slot.

Built through the public launch API of each tree (default + example schemas); bits, columns and
word indices come from the tree, expectations from docs/semantics.md.
"""
from __future__ import annotations

import pytest
import torch
from support import scenarios

SLOTS = [3, 5, 7, 9, 11]          # one request's chain, positions 0..4
TOKENS = [101, 102, 103, 104, 105]


@pytest.fixture(autouse=True, params=["torch", "cpu"])
def host_backend(request, monkeypatch):
    """Every launch here runs on the torch reference and again on the native cpu backend (KV_CANARY_BACKEND):
    the reference is what these expectations check, the cpu backend must meet them too."""
    monkeypatch.setenv("KV_CANARY_BACKEND", request.param)
    return request.param


class World:
    """One canary buffer holding a 5-slot chain written from HEAD, plus launch helpers."""

    def __init__(self, tree, *, mode=None, sources=(), ring_capacity=16, num_slots=16):
        self.tree, self.lay = tree, tree.layout
        self.rt = scenarios.runtime_for(tree)
        self.alloc = tree.allocators
        mode = self.lay.RealKvHashMode.NONE if mode is None else mode
        self.ctx = self.alloc.allocate_context(num_slots=num_slots, ring_capacity=ring_capacity, device="cpu",
                                               real_kv_sources=sources, real_kv_hash_mode=mode)
        self.words = self.ctx.canary_buf.view(torch.int64)
        self.owner = 77
        self.write(SLOTS, TOKENS, list(range(5)))
        self.reset_ring()

    def extra(self, n):
        return {f.name: torch.full((n,), self.owner, dtype=torch.int64) for f in self.lay.INPUT_FIELDS}

    def write(self, slots, tokens, positions, *, seed=-1, expected=None):
        plan = self.alloc.WritePlan.allocate(write_req_capacity=1, device="cpu")
        plan.write_offsets[:2] = torch.tensor([0, len(slots)])
        plan.write_seed_slot_indices[0] = seed
        plan.write_num_valid_reqs.fill_(1)
        t = lambda v: torch.tensor(v, dtype=torch.int64)  # noqa: E731
        self.rt.launch_canary_write_kernel(
            context=self.ctx, plan=plan, input_ids=t(tokens), positions=t(positions), out_cache_loc=t(slots),
            enable_write_input_assert=expected is not None,
            expected_input_tokens=None if expected is None else t(expected[0]),
            expected_input_positions=None if expected is None else t(expected[1]), extra_inputs=self.extra(len(slots)))

    def verify(self, entries, *, check_token=False, num_valid=None, enable=1, capacity=None):
        """entries: (slot, prev, expected position, expected token)."""
        cap = capacity or max(len(entries), 1)
        plan = self.alloc.VerifyPlan.allocate(verify_capacity=cap, device="cpu")
        for i, (slot, prev, pos, tok) in enumerate(entries):
            plan.verify_slot_indices[i], plan.verify_prev_slot_indices[i] = slot, prev
            plan.verify_expected_positions[i], plan.verify_expected_tokens[i] = pos, tok
            for f in self.lay.INPUT_FIELDS:
                if f.verify_expected == "per_request":
                    getattr(plan, "verify_expected_" + f.name)[i] = self.owner
        plan.verify_num_valid.fill_(len(entries) if num_valid is None else num_valid)
        plan.enable.fill_(enable)
        tables = {f.name: torch.full((self.words.shape[0],), self.owner, dtype=torch.int64)
                  for f in self.lay.INPUT_FIELDS if f.verify_expected == "per_slot"}
        self.rt.launch_canary_verify_kernel(context=self.ctx, plan=plan, check_verify_expected_token=check_token,
                                            extra_slot_tables=tables)

    def chain_entries(self):
        return [(s, SLOTS[i - 1] if i else -1, i, TOKENS[i]) for i, s in enumerate(SLOTS)]

    def reset_ring(self):
        self.ctx.violation_ring.zero_()
        self.ctx.violation_write_index.zero_()

    def rows(self):
        n = min(int(self.ctx.violation_write_index[0]), self.ctx.violation_ring.shape[0])
        return [dict(slot=r[self.lay.VIOLATION_COL_SLOT], bits=self.lay.FailReason(r[self.lay.VIOLATION_COL_FAIL_REASON]),
                     aux=r[self.lay.VIOLATION_COL_EXPECTED_AUX], pos=r[self.lay.VIOLATION_COL_STORED_POSITION],
                     token=r[self.lay.VIOLATION_COL_STORED_TOKEN], exp_token=r[self.lay.VIOLATION_COL_EXPECTED_TOKEN],
                     chain=r[self.lay.VIOLATION_COL_STORED_CHAIN_HASH])
                for r in self.ctx.violation_ring[:n].tolist()]


def fired(world):
    return [(r["slot"], r["bits"]) for r in world.rows()]


# -- a clean chain verifies clean -----------------------------------------------------------------------
def test_clean_chain_has_no_rows(any_tree):
    w = World(any_tree)
    w.verify(w.chain_entries(), check_token=True)
    assert fired(w) == []
    assert w.ctx.slot_run_counter.item() == 5 + 5      # 5 written + 5 verified


# -- corruption scenarios ---------------------------------------------------------------------------------
def test_predecessor_token_changed_fires_chain_on_successor(any_tree):
    w = World(any_tree)
    w.words[SLOTS[1], w.lay.CANARY_TOKEN_WORD] += 1
    w.verify(w.chain_entries())
    assert fired(w) == [(SLOTS[2], w.lay.FailReason.VERIFY_CHAIN_HASH_MISMATCH)]


def test_position_shifted_fires_position(any_tree):
    w = World(any_tree)
    w.words[SLOTS[2], w.lay.CANARY_POSITION_WORD] += 1
    w.verify(w.chain_entries())
    fr = w.lay.FailReason
    assert fired(w) == [(SLOTS[2], fr.VERIFY_POSITION_MISMATCH), (SLOTS[3], fr.VERIFY_CHAIN_HASH_MISMATCH)]
    assert w.rows()[0]["pos"] == 3      # the row carries the stored position


@pytest.mark.parametrize("mode", ["PARTIAL", "ALL", "NONE"])
def test_real_kv_byte_flipped(any_tree, mode):
    alloc = any_tree.allocators
    kv = torch.randint(0, 256, (16, 4 * 64), dtype=torch.uint8)
    src = alloc.RealKvSource(tensor=kv, page_size=4, num_bytes_per_token=64, read_bytes=48)
    w = World(any_tree, mode=any_tree.layout.RealKvHashMode[mode], sources=(src,))
    kv[SLOTS[3] // 4, (SLOTS[3] % 4) * 64 + 5] ^= 0x10
    w.verify(w.chain_entries())
    want = [] if mode == "NONE" else [(SLOTS[3], any_tree.layout.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)]
    assert fired(w) == want
    # A byte past the read window changes nothing in any mode.
    w.reset_ring()
    kv[SLOTS[1] // 4, (SLOTS[1] % 4) * 64 + 50] ^= 0x10
    w.verify(w.chain_entries())
    assert fired(w) == want


def test_wrong_token_with_check_on_fires_token(any_tree):
    w = World(any_tree)
    entries = w.chain_entries()
    entries[4] = (SLOTS[4], SLOTS[3], 4, 999)
    entries[2] = (SLOTS[2], SLOTS[1], 2, -1)          # expected token -1: unknown, never fires
    w.verify(entries, check_token=False)
    assert fired(w) == []
    w.verify(entries, check_token=True)
    assert fired(w) == [(SLOTS[4], w.lay.FailReason.VERIFY_TOKEN_MISMATCH)]
    assert w.rows()[0]["exp_token"] == 999 and w.rows()[0]["token"] == TOKENS[4]


def test_write_input_mismatches(any_tree):
    w = World(any_tree)
    fr = w.lay.FailReason
    w.write([12, 13], [7, 8], [5, 6], seed=SLOTS[4], expected=([7, 9], [4, 6]))
    assert fired(w) == [(12, fr.WRITE_POSITION_MISMATCH), (13, fr.WRITE_TOKEN_MISMATCH)]
    first = w.rows()[0]
    assert (first["aux"], first["exp_token"], first["pos"]) == (4, 7, 5)


def test_write_chain_position_assert(any_tree):
    w = World(any_tree)
    w.write([12, 13], [7, 8], [6, 7], seed=SLOTS[4])       # seed position 4 -> expected 5, got 6
    rows = w.rows()
    assert fired(w) == [(12, w.lay.FailReason.WRITE_POSITION_MISMATCH)]
    assert rows[0]["aux"] == 5
    # Disabled flag (warm-up): no row.
    w.reset_ring()
    w.ctx.enable_chain_position_assert.zero_()
    w.write([14], [9], [42], seed=13)
    assert fired(w) == []


def test_out_of_range_slots_fire_and_never_raise(any_tree):
    w = World(any_tree)
    oor = any_tree.layout.FailReason.SLOT_OUT_OF_RANGE
    w.verify([(99, -1, 0, 5), (SLOTS[1], 123, 1, -1), (-4, -1, 0, -1)], check_token=True)
    rows = w.rows()
    assert fired(w) == [(99, oor), (SLOTS[1], oor), (-4, oor)]
    assert [r["aux"] for r in rows] == [99, 123, -4]
    assert [r["exp_token"] for r in rows] == [5, -1, -1]
    assert all(r["pos"] == r["token"] == r["chain"] == 0 for r in rows)
    w.reset_ring()
    before = w.ctx.canary_buf.clone()
    w.write([12, 40, 13], [1, 2, 3], [5, 6, 6], seed=SLOTS[4])
    assert fired(w) == [(40, oor)]
    # The out-of-range entry is skipped like a padded one: slot 13 chains to slot 12.
    w.verify([(13, 12, 6, -1)])
    assert len(w.rows()) == 1
    w.reset_ring()
    w.ctx.canary_buf.copy_(before)
    w.write([12], [1], [5], seed=77)
    assert fired(w) == [(77, oor)] and torch.equal(w.ctx.canary_buf, before)


# -- sentinels ---------------------------------------------------------------------------------------------
def test_verify_sentinels(any_tree):
    w = World(any_tree)
    fr = w.lay.FailReason
    w.words[SLOTS[2], w.lay.CANARY_CHAIN_LINK_WORD] ^= 1
    counter = w.ctx.slot_run_counter.item()
    # slot 0 = padding (skipped, counted); prev 0 = unreachable (chain check off); prev -1 = HEAD.
    w.verify([(0, -1, 123, 9), (SLOTS[2], 0, 2, -1), (SLOTS[3], -1, 3, -1)])
    rows = w.rows()
    assert fired(w) == [(SLOTS[3], fr.VERIFY_CHAIN_HASH_MISMATCH)]
    assert rows[0]["aux"] == any_tree.layout.CANARY_CHAIN_HEAD - (1 << 64) * (any_tree.layout.CANARY_CHAIN_HEAD >> 63)
    assert w.ctx.slot_run_counter.item() == counter + 3


def test_verify_enable_and_num_valid_clamping(any_tree):
    w = World(any_tree)
    w.words[SLOTS[0], w.lay.CANARY_POSITION_WORD] = 50
    kernels, slots = w.ctx.kernel_run_counter.item(), w.ctx.slot_run_counter.item()
    w.verify(w.chain_entries(), enable=0)
    assert fired(w) == [] and w.ctx.kernel_run_counter.item() == kernels + 1
    assert w.ctx.slot_run_counter.item() == slots
    w.verify(w.chain_entries(), num_valid=-3)
    assert fired(w) == [] and w.ctx.slot_run_counter.item() == slots
    w.verify(w.chain_entries(), num_valid=1000)      # clamped to the capacity (5)
    fr = w.lay.FailReason
    assert fired(w) == [(SLOTS[0], fr.VERIFY_POSITION_MISMATCH), (SLOTS[1], fr.VERIFY_CHAIN_HASH_MISMATCH)]
    assert w.ctx.slot_run_counter.item() == slots + 5


def test_write_sentinels(any_tree):
    w = World(any_tree)
    # out_cache_loc < 0 is skipped: not stored, not counted, the chain does not advance.
    slots_before = w.ctx.slot_run_counter.item()
    w.write([12, -1, 13], [1, 2, 3], [5, 6, 6], seed=SLOTS[4])
    assert w.ctx.slot_run_counter.item() == slots_before + 2
    w.verify([(12, SLOTS[4], 5, -1), (13, 12, 6, -1)])
    assert fired(w) == []


def test_ring_overflow_keeps_counting(any_tree):
    w = World(any_tree, ring_capacity=2)
    w.verify([(99, -1, 0, -1)] * 5)
    assert w.ctx.violation_write_index.item() == 5
    assert len(w.rows()) == 2


def test_plan_sentinels_and_overflow(any_tree):
    lay = any_tree.layout
    alloc = any_tree.allocators
    rt = scenarios.runtime_for(any_tree)
    r2t = torch.arange(1, 4 * 8 + 1, dtype=torch.int32).view(4, 8)
    extra = {f.name: torch.tensor([5, 6, 7]) for f in lay.INPUT_FIELDS if f.verify_expected == "per_request"}

    def run(cap, rows, prefixes, extends):
        vp = alloc.VerifyPlan.allocate(verify_capacity=cap, device="cpu")
        wp = alloc.WritePlan.allocate(write_req_capacity=4, device="cpu")
        rt.launch_canary_plan_kernels(
            verify_plan_out=vp, write_plan_out=wp, req_pool_indices=torch.tensor(rows), prefix_lens=torch.tensor(prefixes),
            extend_seq_lens=torch.tensor(extends), req_to_token=r2t, swa_window_size=0, full_to_swa_index_mapping=None,
            verify_capacity=cap, req_to_verify_expected_tokens=None, req_to_verify_expected_tokens_valid_lens=None,
            kv_token_id_vs_position_offset=0, extra_request_values=extra)
        return vp, wp

    # Request 1 is the padding row: no entries, no extend, seed -1; its range is empty.
    vp, wp = run(8, [2, lay.REQ_POOL_IDX_PADDING, 3], [2, 4, 1], [3, 5, 2])
    assert vp.enable.item() == 1 and vp.verify_num_valid.item() == 3
    assert vp.verify_slot_indices[:3].tolist() == [r2t[2, 0].item(), r2t[2, 1].item(), r2t[3, 0].item()]
    assert vp.verify_prev_slot_indices[:3].tolist() == [-1, r2t[2, 0].item(), -1]
    assert vp.verify_expected_positions[:3].tolist() == [0, 1, 0]
    assert vp.verify_expected_tokens[:3].tolist() == [-1, -1, -1]
    for name in extra:
        assert getattr(vp, "verify_expected_" + name)[:3].tolist() == [5, 5, 7]
    assert wp.write_offsets.tolist() == [0, 3, 3, 5, 0]
    assert wp.write_seed_slot_indices[:3].tolist() == [r2t[2, 1].item(), -1, r2t[3, 0].item()]
    assert wp.write_num_valid_reqs.item() == 3
    # Overflow: enable 0, num_valid = capacity, entries untouched.
    vp, _ = run(2, [2, 1, 3], [2, 4, 1], [3, 5, 2])
    assert vp.enable.item() == 0 and vp.verify_num_valid.item() == 2
    assert vp.verify_slot_indices.tolist() == [0, 0]
