"""The generated layout follows the schema: a mutated schema (extra `epoch` input field, stride 64)
and the golden-record hex dump in LAYOUT.md (checked against tests/spec/vectors.json (docs/semantics.md §10))."""
from __future__ import annotations

from pathlib import Path

import pytest
from kv_canary.codegen.load import load_schema
from kv_canary.codegen.render import render_all, split_header
from support.trees import default_schema_text, load_vectors

ROOT = Path(__file__).resolve().parents[2]
VECTORS = load_vectors()


def epoch_schema_text() -> str:
    text = default_schema_text(stride=64)
    edits = [("      - {name: real_kv_hash, role: kv_fingerprint}\n",
              "      - {name: real_kv_hash, role: kv_fingerprint}\n      - {name: epoch, role: input, source: allocation_epoch}\n")]
    for old, new in edits:
        assert text.count(old) == 1
        text = text.replace(old, new)
    return text


@pytest.fixture(scope="module")
def epoch_schema_path(tmp_path_factory):
    path = tmp_path_factory.mktemp("epoch") / "epoch.yaml"
    path.write_text(epoch_schema_text(), encoding="utf-8")
    return path


def layout_md(schema_path: Path) -> str:
    files = render_all(load_schema(schema_path), schema_path.read_text(encoding="utf-8"))
    return split_header(next(f.text for f in files if f.path == "LAYOUT.md"))[1]


def hexdump_rows(md: str) -> list[tuple[int, bytes, str, str]]:
    block = md.split("## Golden record", 1)[1].split("```", 2)[1]
    rows = []
    for line in block.strip().splitlines()[1:]:
        offset, rest = line.split("  ", 1)
        hex_part, rest = rest[:23], rest[25:]
        field, _, value = rest.partition("  ")
        rows.append((int(offset, 16), bytes.fromhex(hex_part), field.strip(), value.strip()))
    return rows


def test_mutated_schema_tree_reports_the_new_layout(epoch_schema_path):
    from support.trees import generate_tree
    layout = generate_tree(epoch_schema_path).layout
    assert layout.CANARY_SLOT_STRIDE_BYTES == 64
    assert layout.CANARY_FIELDS_PER_SLOT == 5
    assert layout.CANARY_RECORD_BYTES == 40
    assert layout.CANARY_FIELD_EPOCH == 4
    assert layout.CANARY_FIELD_OFFSETS == (0, 8, 16, 24, 32)
    # The roles the kernels use did not move.
    assert (layout.CANARY_TOKEN_WORD, layout.CANARY_POSITION_WORD, layout.CANARY_CHAIN_LINK_WORD,
            layout.CANARY_KV_FINGERPRINT_WORD) == (0, 1, 2, 3)
    assert [(f.name, f.word, f.chained, f.verify_expected) for f in layout.INPUT_FIELDS] == [("epoch", 4, False, None)]
    # The fingerprint identifies the layout: it differs from the default schema's.
    default = load_schema(ROOT / "kernels.yaml")
    from kv_canary.codegen.load import layout_fingerprint
    assert layout.LAYOUT_FINGERPRINT != layout_fingerprint(default)


def test_mutated_schema_minimum_stride_message_quotes_the_new_field_count(epoch_schema_path):
    schema = load_schema(epoch_schema_path)
    assert schema.message("canary_stride").text == "canary_buf slot stride must hold at least 5 int64 fields, got {n}"


def test_mutated_schema_layout_md(epoch_schema_path):
    md = layout_md(epoch_schema_path)
    assert "Slot stride 64 bytes (record 40 bytes, 5 little-endian int64 words)." in md
    assert "| 4 | 32 | `epoch` | input (allocation_epoch) | no | - |" in md
    rows = hexdump_rows(md)
    assert [r[0] for r in rows] == list(range(0, 64, 8))
    assert rows[4] == (32, bytes(8), "epoch", "0")
    assert [r[2] for r in rows[5:]] == ["(padding)"] * 3


def test_golden_record_hexdump_matches_vectors_json():
    first = VECTORS["chain_example"]["records"][0]
    rows = [r for r in hexdump_rows(layout_md(ROOT / "kernels.yaml")) if r[2] != "(padding)"]
    assert [(r[0], r[2]) for r in rows] == [(0, "token"), (8, "position"), (16, "prev_hash"), (24, "real_kv_hash")]
    assert rows[0][1] == first["token"].to_bytes(8, "little", signed=True)
    assert rows[1][1] == first["position"].to_bytes(8, "little", signed=True)
    assert rows[2][1] == first["prev_hash_i64"].to_bytes(8, "little", signed=True)
    assert rows[3][1] == bytes(8)
    assert rows[2][3].startswith(f"0x{int(first['prev_hash_u64'], 16):016X} = HEAD")


def test_golden_record_follows_a_reordered_layout():
    rows = hexdump_rows(layout_md(ROOT / "kv_canary" / "schemas" / "wide_stride.yaml"))
    fields = {r[2]: r for r in rows if r[2] != "(padding)"}
    assert fields["token"][1] == (11).to_bytes(8, "little")
    schema = load_schema(ROOT / "kv_canary" / "schemas" / "wide_stride.yaml")
    assert fields["prev_hash"][1] == schema.chain_head.to_bytes(8, "little")
    assert [r[0] for r in rows] == list(range(0, schema.canary.stride_bytes, 8))


def test_describe_prints_the_layout_tables(capsys):
    from kv_canary.codegen.cli import main
    assert main(["describe", "--schema", str(ROOT / "kernels.yaml")]) == 0
    out = capsys.readouterr().out
    assert out == layout_md(ROOT / "kernels.yaml")
    assert "| 3 | 24 | `real_kv_hash` | kv_fingerprint | no | - |" in out
