"""docs/sglang-compat.md stays honest: every row of its tables names the tests that pin it, and every
named test exists as a test pytest collects."""
from __future__ import annotations

import fnmatch
import importlib
import inspect
import re
from pathlib import Path

from support.trees import ROOT

LEDGER = ROOT / "docs" / "sglang-compat.md"
COLUMNS = ["Call / argument", "SGLang", "kv-canary", "Why", "Pinned by"]
TEST_REF = re.compile(r"`(tests/[\w/]+\.py::\w+)`")


def _cells(line: str) -> list[str]:
    """The cells of a markdown table line (`\\|` is a pipe inside a cell)."""
    return [c.strip() for c in re.split(r"(?<!\\)\|", line.strip())[1:-1]]


def ledger_rows() -> list[list[str]]:
    """Every body row of every table, checked against the column header of its table."""
    rows, header = [], None
    for number, line in enumerate(LEDGER.read_text(encoding="utf-8").splitlines(), 1):
        if not line.startswith("|"):
            header = None
            continue
        cells = _cells(line)
        if header is None:
            header = cells
            assert header == COLUMNS, f"{LEDGER.name}:{number}: table columns {header}, want {COLUMNS}"
        elif not set("".join(cells)) <= set("-: "):
            assert len(cells) == len(COLUMNS) and all(cells), f"{LEDGER.name}:{number}: a row needs all {len(COLUMNS)} cells"
            rows.append(cells)
    return rows


def test_every_row_names_a_pinning_test():
    rows = ledger_rows()
    assert len(rows) >= 10, f"the ledger lists {len(rows)} rows"
    for row in rows:
        assert TEST_REF.findall(row[-1]), f"row {row[0]!r} names no test as tests/file.py::test_name"


def test_every_named_test_is_collected(request):
    """Each named test is a function pytest collects: a `python_files` module of tests/, a
    `python_functions` name in it. Checked in this process (a collection subprocess would pay
    another torch import, most of this file's cost)."""
    file_patterns = request.config.getini("python_files")
    function_prefixes = request.config.getini("python_functions")
    for ref in sorted({ref for row in ledger_rows() for ref in TEST_REF.findall(row[-1])}):
        path, name = ref.split("::")
        assert (ROOT / path).is_file(), f"{ref}: no such file"
        assert any(fnmatch.fnmatch(Path(path).name, p) for p in file_patterns), f"{ref}: pytest does not collect {path}"
        module = importlib.import_module(path.removeprefix("tests/").removesuffix(".py").replace("/", "."))
        func = getattr(module, name, None)
        assert inspect.isfunction(func), f"{ref}: no test function {name} in {path}"
        assert any(name.startswith(p) for p in function_prefixes), f"{ref}: pytest does not collect {name}"
