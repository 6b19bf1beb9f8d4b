"""Golden vectors of tests/spec/vectors.json (docs/semantics.md §10) through the public API (default schema)."""
from __future__ import annotations

import importlib

import pytest
import torch
from support.oracle import Oracle, s64, sm64
from support.trees import load_vectors

import kv_canary
from kv_canary import FailReason, RealKvHashMode

VECTORS = load_vectors()
REF = importlib.import_module("kv_canary.generated.reference")


@pytest.fixture(autouse=True, params=["torch", "cpu"])
def host_backend(request, monkeypatch):
    """Every launch here runs on the torch reference and again on the native cpu backend (KV_CANARY_BACKEND):
    the reference is what these expectations check, the cpu backend must meet them too."""
    monkeypatch.setenv("KV_CANARY_BACKEND", request.param)
    return request.param


def h(x: str) -> int:
    return int(x, 16)


@pytest.mark.parametrize("vec", VECTORS["splitmix64"], ids=lambda v: v["in"])
def test_splitmix64(vec):
    assert kv_canary.splitmix64(h(vec["in"])) == h(vec["out"])
    assert sm64(h(vec["in"])) == h(vec["out"])
    as_tensor = REF.splitmix64_t(torch.tensor([s64(h(vec["in"]))], dtype=torch.int64))
    assert as_tensor.item() == s64(h(vec["out"]))


def write_chain(ctx, slots, tokens, positions, seed=-1):
    plan = kv_canary.WritePlan.allocate(write_req_capacity=1, device="cpu")
    plan.write_offsets[:2] = torch.tensor([0, len(slots)])
    plan.write_seed_slot_indices[0] = seed
    plan.write_num_valid_reqs.fill_(1)
    kv_canary.launch_canary_write_kernel(
        context=ctx, plan=plan, input_ids=torch.tensor(tokens, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64), out_cache_loc=torch.tensor(slots, dtype=torch.int64),
        enable_write_input_assert=False)


def test_chain_example_records_and_bytes():
    ex = VECTORS["chain_example"]
    assert kv_canary.generated.layout.CANARY_CHAIN_HEAD == h(ex["head_hash"])
    assert kv_canary.CANARY_CHAIN_ANCHOR == h(ex["anchor"])
    ctx = kv_canary.allocate_context(num_slots=8, ring_capacity=4, device="cpu")
    recs = ex["records"]
    write_chain(ctx, [2, 3, 4, 5, 6], [r["token"] for r in recs], [r["position"] for r in recs])
    words = ctx.canary_buf.view(torch.int64)
    for slot, rec in zip(range(2, 7), recs):
        assert words[slot, kv_canary.CANARY_FIELD_TOKEN] == rec["token"]
        assert words[slot, kv_canary.CANARY_FIELD_POSITION] == rec["position"]
        assert words[slot, kv_canary.CANARY_FIELD_PREV_HASH] == rec["prev_hash_i64"]
        assert s64(h(rec["prev_hash_u64"])) == rec["prev_hash_i64"]
        assert words[slot, kv_canary.CANARY_FIELD_REAL_KV_HASH] == 0
    # Byte level: slot 2 starts with the token as a little-endian int64.
    assert ctx.canary_buf[2, :8].tolist() == list((11).to_bytes(8, "little"))
    # The link after the last record seeds the next write.
    write_chain(ctx, [7], [66], [5], seed=6)
    assert words[7, kv_canary.CANARY_FIELD_PREV_HASH] == s64(h(ex["next_link_after_last"]))
    assert ctx.slot_run_counter.item() == 6 and ctx.kernel_run_counter.item() == 2
    assert ctx.violation_write_index.item() == 0


def test_link_with_negative_values():
    vec = VECTORS["link_negative"]
    rec = torch.zeros((1, kv_canary.CANARY_FIELDS_PER_SLOT), dtype=torch.int64)
    rec[0, kv_canary.CANARY_FIELD_PREV_HASH] = s64(h(vec["prev"]))
    rec[0, kv_canary.CANARY_FIELD_TOKEN] = vec["token"]
    rec[0, kv_canary.CANARY_FIELD_POSITION] = vec["position"]
    assert REF.link_t(rec).item() == s64(h(vec["link"]))
    assert Oracle(kv_canary.generated).link(h(vec["prev"]), [vec["token"], vec["position"]]) == h(vec["link"])


def kv_sources():
    s0 = torch.arange(0x00, 0x10, dtype=torch.uint8).view(1, 16)
    s1 = torch.arange(0x10, 0x30, dtype=torch.uint8).view(1, 32)
    return (kv_canary.RealKvSource(tensor=s0, page_size=1, num_bytes_per_token=16, read_bytes=16),
            kv_canary.RealKvSource(tensor=s1, page_size=1, num_bytes_per_token=32, read_bytes=32))


def test_real_kv_fold():
    vec = VECTORS["real_kv_fold"]
    s0, s1 = kv_sources()
    slot = torch.tensor([0])
    fp, oor = REF.fingerprint(slot, (s0,), RealKvHashMode.ALL)
    assert fp.item() == s64(h(vec["total_one_source"])) and not oor.any()
    assert sm64(0 ^ h(vec["source0_hash"])) == h(vec["total_one_source"])
    fp, _ = REF.fingerprint(slot, (s0, s1), RealKvHashMode.ALL)
    assert fp.item() == s64(h(vec["total_two_sources"]))
    assert sm64(h(vec["total_one_source"]) ^ h(vec["source1_hash"])) == h(vec["total_two_sources"])
    assert REF.fingerprint(slot, (s0, s1), RealKvHashMode.NONE)[0].item() == 0
    # PARTIAL reads 16 bytes of every source regardless of read_bytes.
    s1_partial = kv_canary.RealKvSource(tensor=s1.tensor[:, :16].contiguous(), page_size=1, num_bytes_per_token=16,
                                        read_bytes=16)
    assert REF.fingerprint(slot, (s0, s1), RealKvHashMode.PARTIAL)[0].item() == \
        REF.fingerprint(slot, (s0, s1_partial), RealKvHashMode.ALL)[0].item()


def test_written_fingerprint_is_stored_and_verifies():
    """The golden fingerprint is stored at write time, verifies clean, and a flipped real-KV byte
    makes verify report REAL_KV (and only REAL_KV) on that slot."""
    vec = VECTORS["real_kv_fold"]
    golden = s64(h(vec["total_two_sources"]))
    # Two one-token pages with the golden bytes each, so slots 0 and 1 both fingerprint to `golden`.
    s0, s1 = (kv_canary.RealKvSource(tensor=src.tensor.repeat(2, 1), page_size=1,
                                     num_bytes_per_token=src.num_bytes_per_token, read_bytes=src.read_bytes)
              for src in kv_sources())
    ctx = kv_canary.allocate_context(num_slots=2, ring_capacity=4, device="cpu", real_kv_sources=(s0, s1),
                                     real_kv_hash_mode=RealKvHashMode.ALL)
    write_chain(ctx, [0], [5], [0])       # slot 0 is written like any other slot
    write_chain(ctx, [1], [7], [0])
    words = ctx.canary_buf.view(torch.int64)
    assert words[0, kv_canary.CANARY_FIELD_REAL_KV_HASH] == golden
    assert words[1, kv_canary.CANARY_FIELD_REAL_KV_HASH] == golden
    assert ctx.violation_write_index.item() == 0

    plan = kv_canary.VerifyPlan.allocate(verify_capacity=1, device="cpu")
    plan.verify_slot_indices[0] = 1
    plan.verify_prev_slot_indices[0] = -1          # chain head
    plan.verify_expected_positions[0] = 0
    plan.verify_expected_tokens[0] = -1
    plan.verify_num_valid.fill_(1)
    plan.enable.fill_(1)
    kv_canary.launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=False)
    assert ctx.violation_write_index.item() == 0, ctx.violation_ring[:1].tolist()

    s1.tensor[1, 3] ^= 0x40                        # a byte that slot 1's ALL-mode fingerprint reads
    kv_canary.launch_canary_verify_kernel(context=ctx, plan=plan, check_verify_expected_token=False)
    assert ctx.violation_write_index.item() == 1
    row = ctx.violation_ring[0].tolist()
    lay = kv_canary.generated.layout
    head = s64(h(VECTORS["chain_example"]["head_hash"]))
    assert row[lay.VIOLATION_COL_FAIL_REASON] == FailReason.VERIFY_REAL_KV_HASH_MISMATCH == 4
    assert row[lay.VIOLATION_COL_SLOT] == 1
    assert (row[lay.VIOLATION_COL_STORED_POSITION], row[lay.VIOLATION_COL_STORED_TOKEN]) == (0, 7)
    assert row[lay.VIOLATION_COL_EXPECTED_TOKEN] == -1
    assert row[lay.VIOLATION_COL_STORED_CHAIN_HASH] == row[lay.VIOLATION_COL_EXPECTED_AUX] == head
