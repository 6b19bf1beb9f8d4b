"""Negative-schema goldens: every file in tests/codegen/schema_errors/ states its exact diagnostics.

Each case is kernels.yaml with one small change; its leading comment lists the expected lines as
`# expect: FILE:LINE:COL: error: MESSAGE` (FILE is the case's basename). A few cases run through
the real CLI in a subprocess (exit status, stderr, no traceback); the rest call the loader.
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.load import load_schema

ROOT = Path(__file__).resolve().parents[2]
CASES_DIR = Path(__file__).resolve().parent / "schema_errors"
CASES = sorted(CASES_DIR.glob("*.yaml"))
# Run through the CLI: a YAML syntax error, an injection attempt, a multi-error file, a semantic error,
# an alias bomb and a key that tries to forge a diagnostic line of its own.
CLI_CASES = ("yaml_syntax", "injection_field_name", "wrong_types", "stride_too_small", "yaml_alias_bomb",
             "forged_diagnostic_line")


def expected(path: Path) -> list[str]:
    lines = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if not line.startswith("#"):
            break
        if line.startswith("# expect: "):
            lines.append(line[len("# expect: "):])
    return lines


def run_cli(*args: str, cwd: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.run([sys.executable, "-m", "codegen", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=60)


def summary(n: int) -> str:
    return f"{n} error{'s' if n != 1 else ''}"


def test_there_are_enough_cases():
    assert len(CASES) >= 30
    for path in CASES:
        assert expected(path), f"{path.name} has no '# expect:' lines"


@pytest.mark.parametrize("path", [p for p in CASES if p.stem not in CLI_CASES], ids=lambda p: p.stem)
def test_loader_reports_exactly_the_expected_diagnostics(path):
    with pytest.raises(SchemaError) as info:
        load_schema(path)
    assert str(info.value).splitlines() == expected(path)


@pytest.mark.parametrize("stem", CLI_CASES)
def test_cli_check_prints_the_diagnostics_and_exits_1(stem, tmp_path):
    path = CASES_DIR / f"{stem}.yaml"
    want = expected(path)
    proc = run_cli("check", "--schema", path.name, "--out", str(tmp_path / "generated"), cwd=CASES_DIR)
    assert proc.returncode == 1
    assert proc.stdout == ""
    assert proc.stderr == "\n".join(want + [summary(len(want))]) + "\n"


def test_generate_refuses_a_bad_schema_and_writes_nothing(tmp_path):
    out = tmp_path / "generated"
    proc = run_cli("generate", "--schema", str(CASES_DIR / "flag_duplicate_bit.yaml"), "--out", str(out), cwd=tmp_path)
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
    for path in CASES:
        locs = []
        for line in expected(path):
            _, ln, col, _ = line.split(":", 3)
            locs.append((int(ln), int(col)))
        assert locs == sorted(locs), path.name
