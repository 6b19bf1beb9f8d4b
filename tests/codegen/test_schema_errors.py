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
from kv_canary.codegen.load import load_schema
from support.mutations import EditDrift
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
