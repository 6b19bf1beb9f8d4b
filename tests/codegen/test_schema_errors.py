"""Negative-schema goldens: every case of tests/support/schema_errors.py states its exact diagnostics.

Each case is a few literal edits of kernels.yaml and the lines the generator must print for the edited
file, `FILE:LINE:COL: error: MESSAGE` (FILE is `<case>.yaml`). A few cases run through the real CLI in
a subprocess (exit status, stderr, no traceback); the rest call the loader.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.diff import diff_schemas
from kv_canary.codegen.load import layout_fingerprint, load_schema, load_schema_text
from kv_canary.codegen.render import render_all, split_header
from support.mutations import EditDrift, edit
from support.schema_errors import CASES, Case, case

ROOT = Path(__file__).resolve().parents[2]
# Run through the CLI: a YAML syntax error, an injection attempt, a multi-error file, a semantic error,
# an alias bomb and a key that tries to forge a diagnostic line of its own.
CLI_CASES = ("yaml_syntax", "injection_field_name", "wrong_types", "stride_too_small", "yaml_alias_bomb",
             "forged_diagnostic_line")


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "codegen", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def summary(n: int) -> str:
    return f"{n} error{'s' if n != 1 else ''}"


def test_there_are_enough_cases():
    assert len(CASES) >= 30
    assert len({c.name for c in CASES}) == len(CASES)
    for c in CASES:
        assert c.expect, f"{c.name} expects no diagnostic"
        assert (c.whole is None) == bool(c.edits), f"{c.name}: edits of kernels.yaml or a whole text, not both"


def test_an_edit_that_no_longer_matches_names_its_case():
    stale = Case("stale_case", "an edit of a line kernels.yaml no longer has", [("format: 0\n", "format: 2\n")], ("1:1: x",))
    with pytest.raises(EditDrift, match=r"^stale_case: edit expects 1 occurrence of 'format: 0\\n' .* found 0"):
        stale.text()


@pytest.mark.parametrize("c", [c for c in CASES if c.name not in CLI_CASES], ids=lambda c: c.name)
def test_loader_reports_exactly_the_expected_diagnostics(c, tmp_path):
    with pytest.raises(SchemaError) as info:
        load_schema(c.write(tmp_path))
    assert str(info.value).splitlines() == c.diagnostics()


@pytest.mark.parametrize("name", CLI_CASES)
def test_cli_check_prints_the_diagnostics_and_exits_1(name, tmp_path):
    c = case(name)
    want = c.diagnostics()
    proc = run_cli("check", "--schema", c.write(tmp_path).name, "--out", str(tmp_path / "generated"), cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == "\n".join(want + [summary(len(want))]) + "\n"


def test_generate_refuses_a_bad_schema_and_writes_nothing(tmp_path):
    out = tmp_path / "generated"
    proc = run_cli("generate", "--schema", str(case("flag_duplicate_bit").write(tmp_path)), "--out", str(out),
                   cwd=tmp_path)
    assert proc.returncode == 1
    assert "reuses bit value 32" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()


def test_missing_file_is_one_diagnostic(tmp_path):
    proc = run_cli("check", "--schema", "nope.yaml", cwd=tmp_path)
    assert proc.returncode == 1
    assert proc.stderr == "nope.yaml:1:1: error: cannot read schema nope.yaml: No such file or directory\n1 error\n"


def test_non_utf8_bytes_are_one_diagnostic(tmp_path):
    text = (ROOT / "kernels.yaml").read_bytes().replace(b'"seed of every hash chain', b'"seed \xff of every')
    (tmp_path / "latin.yaml").write_bytes(text)
    proc = run_cli("check", "--schema", "latin.yaml", cwd=tmp_path)
    assert proc.returncode == 1
    offset = text.index(b"\xff")
    line = text.count(b"\n", 0, offset) + 1
    col = offset - text.rindex(b"\n", 0, offset)
    assert proc.stderr == (f"latin.yaml:{line}:{col}: error: schema is not UTF-8: invalid start byte "
                           f"(byte 0xFF at offset {offset})\n1 error\n")


def test_diagnostics_are_sorted_by_line_then_column():
    for c in CASES:
        locs = [tuple(int(n) for n in line.split(":", 2)[:2]) for line in c.expect]
        assert locs == sorted(locs), c.name


# kernels.yaml before the generator supplied what the kernels fix (issue 21): the real-KV load width,
# the real-KV source record and the kinds of the built-in fail reasons, each stated by the schema.
OLD_FORM_EDITS = [
    ("  REAL_KV_PARTIAL_READ_BYTES:", '  REAL_KV_LOAD_ALIGN_BYTES: {type: i32, value: 16, doc: "vector load width; read '
                                      'sizes and row strides are multiples of it"}\n  REAL_KV_PARTIAL_READ_BYTES:'),
    ("carries: fail_reason}\n", "carries: fail_reason}\n\n  real_kv_source:\n    word: int32\n    fields:\n"
                                "      - {name: page_size}\n      - {name: num_bytes_per_token}\n      - {name: read_bytes}\n"),
] + [(f"    {name}: {bit}\n", f"    {name}: {{value: {bit}, kind: {kind}}}\n") for name, bit, kind in (
    ("VERIFY_CHAIN_HASH_MISMATCH", 1, "verify"), ("VERIFY_POSITION_MISMATCH", 2, "verify"),
    ("VERIFY_REAL_KV_HASH_MISMATCH", 4, "verify"), ("WRITE_TOKEN_MISMATCH", 8, "write"),
    ("WRITE_POSITION_MISMATCH", 16, "write"), ("VERIFY_TOKEN_MISMATCH", 32, "verify"), ("SLOT_OUT_OF_RANGE", 64, "both"))]


def test_a_schema_that_still_states_the_fixed_facts_is_the_same_schema():
    """An existing kernels.yaml keeps working: restating a fact the generator supplies, the same way,
    changes nothing generated (a different statement is an error: the *_builtin_* and real_kv_* cases)."""
    text = (ROOT / "kernels.yaml").read_text(encoding="utf-8")
    old = text
    for e in OLD_FORM_EDITS:
        old = edit(old, *e, case="old form of kernels.yaml")
    new_schema, old_schema = load_schema_text(text), load_schema_text(old)
    def at(start: str) -> int:
        return next(i for i, line in enumerate(old.splitlines(), 1) if line.startswith(start))
    assert old_schema.notes == (
        f"kernels.yaml:{at('  REAL_KV_LOAD_ALIGN_BYTES:')}:3: note: constant 'REAL_KV_LOAD_ALIGN_BYTES' is supplied "
        f"by the generator (i32 16); this line can be removed",
        f"kernels.yaml:{at('  real_kv_source:')}:3: note: record 'real_kv_source' is supplied by the generator; it "
        f"can be removed",
        f"kernels.yaml:{at('    VERIFY_CHAIN_HASH_MISMATCH:')}:5: note: the kinds of the built-in fail reasons are "
        f"supplied by the generator; 7 stated here can be removed (write VERIFY_CHAIN_HASH_MISMATCH: 1)")
    assert new_schema.notes == ()
    assert layout_fingerprint(old_schema) == layout_fingerprint(new_schema)
    assert not diff_schemas(old_schema, new_schema).changes
    def bodies(schema, source):  # the generation id hashes the schema's text: the one line that may differ
        return [(f.path, [line for line in split_header(f.text)[1].splitlines() if "GENERATION_ID = " not in line])
                for f in render_all(schema, source)]
    assert bodies(old_schema, old) == bodies(new_schema, text)


def test_generate_prints_the_notes_of_an_old_schema_and_succeeds(tmp_path):
    text = (ROOT / "kernels.yaml").read_text(encoding="utf-8")
    for e in OLD_FORM_EDITS:
        text = edit(text, *e, case="old form of kernels.yaml")
    (tmp_path / "old.yaml").write_text(text, encoding="utf-8")
    proc = run_cli("generate", "--schema", "old.yaml", "--out", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [n.replace("kernels.yaml:", "old.yaml:", 1)
                                        for n in load_schema_text(text).notes]


# kernels.yaml before `operation:` was named so (issue 30): each kernel named its operation `template:`.
FORMER_KEY_EDITS = [(f"    operation: {op}\n", f"    template: {op}\n")
                    for op in ("write", "verify", "plan_offsets", "plan_entries", "scatter")]


def test_the_former_key_template_is_the_key_operation_with_a_note(tmp_path):
    """A kernel's `template:` still names its operation: one located note per kernel, the same schema
    and the same generated tree (the `.cu` files byte for byte); `generate` prints the notes and succeeds."""
    text = (ROOT / "kernels.yaml").read_text(encoding="utf-8")
    old = text
    for e in FORMER_KEY_EDITS:
        old = edit(old, *e, case="kernels.yaml with the former key")
    new_schema, old_schema = load_schema_text(text), load_schema_text(old)
    lines = old.splitlines()
    names = {"write": "canary_write", "verify": "canary_verify", "plan_offsets": "canary_plan_offsets",
             "plan_entries": "canary_plan_entries", "scatter": "canary_scatter_req_token_ids"}
    assert old_schema.notes == tuple(
        f"kernels.yaml:{lines.index(f'    template: {op}') + 1}:5: note: 'template' is the former name of "
        f"'operation' in kernel '{name}': it means the same; rename it to 'operation'" for op, name in names.items())
    assert new_schema.notes == ()
    assert [k.operation for k in old_schema.kernels] == [k.operation for k in new_schema.kernels] == list(names)
    assert old_schema.kernels == new_schema.kernels  # locations are not compared
    assert layout_fingerprint(old_schema) == layout_fingerprint(new_schema)
    assert not diff_schemas(old_schema, new_schema).changes
    def bodies(schema, source):  # the generation id hashes the schema's text: the one line that may differ
        return [(f.path, [line for line in split_header(f.text)[1].splitlines() if "GENERATION_ID = " not in line])
                for f in render_all(schema, source)]
    assert bodies(old_schema, old) == bodies(new_schema, text)
    cu = {f.path: f.text for f in render_all(new_schema, text) if f.path.endswith(".cu")}
    assert cu and cu == {f.path: f.text for f in render_all(old_schema, old) if f.path.endswith(".cu")}

    (tmp_path / "old.yaml").write_text(old, encoding="utf-8")
    proc = run_cli("generate", "--schema", "old.yaml", "--out", "out", cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr.splitlines() == [n.replace("kernels.yaml:", "old.yaml:", 1) for n in old_schema.notes]
    assert "error" not in proc.stderr
