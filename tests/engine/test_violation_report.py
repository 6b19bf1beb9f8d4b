"""The multi-line violation report of docs/semantics.md §9, pinned line by line.

Rows are built from values set here; every expected line is written out from §9's format. A
mutated schema (a sweep tag renamed, FailReason bits renumbered) proves the report reads the tag's
phase and the row's bits from the schema, not from names.
"""
from __future__ import annotations

import pytest
from support.mutations import reorder_reasons, sub, tree_of

from kv_canary.engine.reporting import ViolationReporter
from kv_canary.engine.violations import ViolationDecoder


def _row(layout, **values):
    row = [0] * layout.VIOLATION_FIELDS
    for carries, v in values.items():
        row[getattr(layout, "VIOLATION_COL_" + carries.upper())] = v
    return row


def report(tree, row, total=1, overflow=False, step=0):
    L = tree.layout
    v = ViolationDecoder(L).decode_row(row)
    return ViolationReporter(L).message(v, total_violations=total, ring_overflow=overflow, step_when_pumped=step)


def test_verify_row_without_a_token_bit(default_tree):
    L = default_tree.layout
    R = L.FailReason
    row = _row(L, launch_tag=int(L.CanaryLaunchTag.TAIL_V_FULL), slot=23, stored_position=57, stored_token=401,
               expected_token=-1, stored_chain_hash=0x0123456789ABCDEF, expected_aux=-2,
               fail_reason=int(R.VERIFY_CHAIN_HASH_MISMATCH | R.VERIFY_REAL_KV_HASH_MISMATCH))
    assert report(default_tree, row, total=5, step=12).split("\n") == [
        "kv_canary violation: launch_tag=TAIL_V_FULL fail_reason=verify_chain_hash+verify_real_kv_hash slot_idx=23 "
        "position=57 stored_token=401 expected_token=-1 stored_chain_hash=0x0123456789abcdef "
        "expected_aux=0xfffffffffffffffe",
        "KV cache canary violation detected (kernel_kind=TAIL_V_FULL, slot_idx=23, position=57)",
        "canary_kind:       per_forward_tail_v_full",
        "  fail_reasons: verify_chain_hash verify_real_kv_hash",
        "  stored:   token_id=401   position=57 prev_hash=0x0123456789abcdef",
        "  expected: prev_hash=0xfffffffffffffffe",
        "  total_violations=5 ring_overflow=False step_when_pumped=12",
    ]


def test_verify_row_with_the_token_bit_on_a_sweep_tag(default_tree):
    L = default_tree.layout
    R = L.FailReason
    row = _row(L, launch_tag=int(L.CanaryLaunchTag.SWEEP_K_SWA), slot=9, stored_position=3, stored_token=12,
               expected_token=777, stored_chain_hash=0x10, expected_aux=0xABC,
               fail_reason=int(R.VERIFY_TOKEN_MISMATCH | R.VERIFY_POSITION_MISMATCH))
    assert report(default_tree, row, total=2, step=40).split("\n") == [
        "kv_canary violation: launch_tag=SWEEP_K_SWA fail_reason=verify_position+verify_token slot_idx=9 position=3 "
        "stored_token=12 expected_token=777 stored_chain_hash=0x0000000000000010 expected_aux=0x0000000000000abc",
        "KV cache canary violation detected (kernel_kind=SWEEP_K_SWA, slot_idx=9, position=3)",
        "canary_kind:       sweep_k_swa",
        "  fail_reasons: verify_position verify_token",
        "  stored:   token_id=12   position=3 prev_hash=0x0000000000000010",
        "  expected: token_id=777 prev_hash=0x0000000000000abc",
        "  total_violations=2 ring_overflow=False step_when_pumped=40",
    ]


def test_write_row_prints_actual_and_expected_position(default_tree):
    L = default_tree.layout
    R = L.FailReason
    row = _row(L, launch_tag=int(L.CanaryLaunchTag.HEAD_K_SWA), slot=70, stored_position=9, stored_token=5,
               expected_token=6, stored_chain_hash=-0x21524111, expected_aux=8,
               fail_reason=int(R.WRITE_TOKEN_MISMATCH | R.WRITE_POSITION_MISMATCH))
    assert report(default_tree, row, total=3, step=7).split("\n") == [
        "kv_canary violation: launch_tag=HEAD_K_SWA fail_reason=write_token+write_position slot_idx=70 position=9 "
        "stored_token=5 expected_token=6 stored_chain_hash=0xffffffffdeadbeef expected_aux=0x0000000000000008",
        "KV cache canary violation detected (kernel_kind=HEAD_K_SWA, slot_idx=70, position=9)",
        "canary_kind:       per_forward_head_k_swa",
        "  fail_reasons: write_token write_position",
        "  actual:   token_id=5   position=9 prev_hash=0xffffffffdeadbeef",
        "  expected: token_id=6   position=8",
        "  total_violations=3 ring_overflow=False step_when_pumped=7",
    ]


def test_write_position_row_alone(default_tree):
    L = default_tree.layout
    row = _row(L, launch_tag=int(L.CanaryLaunchTag.TAIL_K_FULL), slot=4, stored_position=11, stored_token=31,
               expected_token=31, stored_chain_hash=1, expected_aux=10,
               fail_reason=int(L.FailReason.WRITE_POSITION_MISMATCH))
    lines = report(default_tree, row).split("\n")
    assert lines[3:6] == ["  fail_reasons: write_position", "  actual:   token_id=31   position=11 "
                          "prev_hash=0x0000000000000001", "  expected: token_id=31   position=10"]


def test_unknown_tag_and_no_bits(default_tree):
    L = default_tree.layout
    row = _row(L, launch_tag=4242, slot=1, stored_position=2, stored_token=3, expected_token=4,
               stored_chain_hash=5, expected_aux=6, fail_reason=0)
    assert report(default_tree, row, total=9, overflow=True, step=3).split("\n") == [
        "kv_canary violation: launch_tag=unknown(4242) fail_reason=none slot_idx=1 position=2 stored_token=3 "
        "expected_token=4 stored_chain_hash=0x0000000000000005 expected_aux=0x0000000000000006",
        "KV cache canary violation detected (kernel_kind=unknown(4242), slot_idx=1, position=2)",
        "canary_kind:       unknown(4242)",
        "  fail_reasons: none",
        "  stored:   token_id=3   position=2 prev_hash=0x0000000000000005",
        "  expected: prev_hash=0x0000000000000006",
        "  total_violations=9 ring_overflow=True step_when_pumped=3",
    ]


def test_out_of_range_row_gets_the_verify_body(default_tree):
    # SLOT_OUT_OF_RANGE is raised by both launch kinds: no write bit, so the stored/expected body.
    L = default_tree.layout
    row = _row(L, launch_tag=int(L.CanaryLaunchTag.HEAD_K_FULL), slot=160, expected_token=-1, expected_aux=160,
               fail_reason=int(L.FailReason.SLOT_OUT_OF_RANGE))
    lines = report(default_tree, row, total=4, overflow=True, step=8).split("\n")
    assert lines[3:] == ["  fail_reasons: slot_out_of_range",
                         "  stored:   token_id=0   position=0 prev_hash=0x0000000000000000",
                         "  expected: prev_hash=0x00000000000000a0",
                         "  total_violations=4 ring_overflow=True step_when_pumped=8"]


@pytest.fixture(scope="module")
def renamed_tree():
    """SWEEP_K_FULL renamed to a name without 'SWEEP' (still phase sweep), FailReason bits renumbered."""
    return tree_of(lambda text: sub(r"^  SWEEP_K_FULL:", "  IDLE_SCAN_K_FULL:", reorder_reasons(text)))


def test_the_report_reads_phases_and_bits_from_the_schema(renamed_tree):
    L = renamed_tree.layout
    R = L.FailReason
    scan = L.launch_tag("sweep", "k", "full")
    assert scan.name == "IDLE_SCAN_K_FULL" and int(R.VERIFY_TOKEN_MISMATCH) != 32
    row = _row(L, launch_tag=int(scan), slot=9, stored_position=3, stored_token=12, expected_token=777,
               stored_chain_hash=0x10, expected_aux=0xABC, fail_reason=int(R.VERIFY_TOKEN_MISMATCH))
    lines = report(renamed_tree, row).split("\n")
    assert lines[1:6] == [
        "KV cache canary violation detected (kernel_kind=IDLE_SCAN_K_FULL, slot_idx=9, position=3)",
        "canary_kind:       idle_scan_k_full",
        "  fail_reasons: verify_token",
        "  stored:   token_id=12   position=3 prev_hash=0x0000000000000010",
        "  expected: token_id=777 prev_hash=0x0000000000000abc"]
    write = _row(L, launch_tag=int(L.launch_tag("tail", "v", "swa")), slot=2, stored_position=5, stored_token=1,
                 expected_token=2, expected_aux=4, fail_reason=int(R.WRITE_TOKEN_MISMATCH))
    lines = report(renamed_tree, write).split("\n")
    assert lines[2] == "canary_kind:       per_forward_tail_v_swa"
    assert lines[4:6] == ["  actual:   token_id=1   position=5 prev_hash=0x0000000000000000",
                          "  expected: token_id=2   position=4"]
