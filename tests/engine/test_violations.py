"""Violation decoding, SGLang's log line and cascade grouping (kv_canary.engine.violations)."""
from __future__ import annotations

import random

import pytest

from kv_canary.engine.violations import Violation, ViolationDecoder, ViolationGroup, group_cascades, record_link

STANDARD = ("launch_tag", "slot", "stored_position", "stored_token", "expected_token", "stored_chain_hash",
            "expected_aux", "fail_reason")


def _row(layout, **values):
    row = [0] * layout.VIOLATION_FIELDS
    for carries, v in values.items():
        row[getattr(layout, "VIOLATION_COL_" + carries.upper())] = v
    return row


def test_sglang_log_line_exact(default_tree):
    # The expected text is SGLang's own reporter test (verify path, three bits).
    L = default_tree.layout
    bits = int(L.FailReason.VERIFY_CHAIN_HASH_MISMATCH | L.FailReason.VERIFY_POSITION_MISMATCH
               | L.FailReason.VERIFY_REAL_KV_HASH_MISMATCH)
    row = _row(L, launch_tag=int(L.CanaryLaunchTag.HEAD_K_FULL), slot=17, stored_position=42, stored_token=111,
               expected_token=0, stored_chain_hash=0x1111111111111111, expected_aux=0x2222222222222222, fail_reason=bits)
    v = ViolationDecoder(L).decode_row(row)
    assert v.log_line() == (
        "kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_chain_hash+verify_position+verify_real_kv_hash "
        "slot_idx=17 position=42 stored_token=111 expected_token=0 stored_chain_hash=0x1111111111111111 "
        "expected_aux=0x2222222222222222")


def test_negative_hashes_print_as_u64(default_tree):
    L = default_tree.layout
    row = _row(L, launch_tag=int(L.CanaryLaunchTag.TAIL_V_SWA), stored_chain_hash=-1, expected_aux=-2,
               fail_reason=int(L.FailReason.SLOT_OUT_OF_RANGE), expected_token=-1)
    line = ViolationDecoder(L).decode_row(row).log_line()
    assert "launch_tag=TAIL_V_SWA fail_reason=slot_out_of_range" in line
    assert "stored_chain_hash=0xffffffffffffffff expected_aux=0xfffffffffffffffe" in line
    assert "expected_token=-1" in line


def test_decoder_reads_every_field(any_tree):
    L = any_tree.layout
    dec = ViolationDecoder(L)
    rng = random.Random(7)
    tags = [int(t) for t in L.CanaryLaunchTag]
    bits = [int(b) for b in L.FailReason]
    for _ in range(200):
        values = {c: rng.randrange(-(1 << 63), 1 << 63) for c in STANDARD}
        values["launch_tag"] = rng.choice(tags)
        values["fail_reason"] = sum(b for b in bits if rng.random() < 0.4) or bits[0]
        row = _row(L, **values)
        v = dec.decode_row(row, step=3)
        assert (v.launch_tag_value, v.slot, v.position, v.stored_token, v.expected_token, v.stored_chain_hash,
                v.expected_aux, v.reason_bits) == tuple(values[c] for c in STANDARD)
        assert v.launch_tag == L.CanaryLaunchTag(values["launch_tag"]).name
        assert set(v.reasons) == {m.name for m in L.FailReason if values["fail_reason"] & int(m)}
        assert v.step == 3


def test_unknown_tag_and_bits_are_named(default_tree):
    L = default_tree.layout
    spare = 1 << 40
    v = ViolationDecoder(L).decode_row(_row(L, launch_tag=999, fail_reason=spare | 1))
    assert v.launch_tag == "unknown(999)"
    assert v.reasons[-1] == f"UNKNOWN_0x{spare:x}"


def test_decode_rejects_wrong_width(default_tree):
    with pytest.raises(ValueError, match="violation row must have"):
        ViolationDecoder(default_tree.layout).decode_row([0, 1, 2])


def _v(slot, aux, reasons=("VERIFY_CHAIN_HASH_MISMATCH",), tag=2, step=5):
    return Violation("TAIL_K_FULL", tag, slot, 0, 0, 0, 0, aux, 1, reasons, step=step, kind="verify")


def test_group_cascades_roots_first():
    # Chain 10 -> 11 -> 12: the record at 10 was replaced, 11 and 12 follow it; 30 is unrelated.
    links = {10: 0xA, 11: 0xB, 12: 0xC, 30: 0xD}
    vs = [_v(11, 0xA), _v(30, 0x99), _v(10, 0x55, ("VERIFY_CHAIN_HASH_MISMATCH", "VERIFY_POSITION_MISMATCH")),
          _v(12, 0xB)]
    groups = group_cascades(vs, lambda v: links.get(v.slot))
    assert [g.root.slot for g in groups] == [30, 10]
    assert [v.slot for v in groups[1].cascade] == [11, 12]
    assert groups[0] == ViolationGroup(vs[1])


def test_group_cascades_keeps_launches_apart():
    links = {10: 0xA, 11: 0xB}
    vs = [_v(10, 0x1), _v(11, 0xA, step=6)]
    assert [g.size for g in group_cascades(vs, lambda v: links.get(v.slot))] == [1, 1]


def test_record_link_matches_chain_vector(default_tree):
    # vectors.json chain_example: record 1 (token 22, position 1) has prev = link(record 0).
    L = default_tree.layout
    words = [0] * L.CANARY_FIELDS_PER_SLOT
    words[L.CANARY_TOKEN_WORD], words[L.CANARY_POSITION_WORD] = 11, 0
    words[L.CANARY_CHAIN_LINK_WORD] = L.to_signed64(0xDE7FAE23A9A1B716)
    assert record_link(L, words) == 0x89CD2ABFBEBC0649
