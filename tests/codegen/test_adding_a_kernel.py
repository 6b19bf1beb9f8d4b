"""docs/adding-a-kernel.md: adding a kernel touches at most five files, each of which exists, and every
name the guide tells the reader to edit or call exists; what the operation table derives (public
launches, CUDA source templates, reference bindings, the cpu library's entry points) covers every
operation, so that nothing else needs an edit."""
from __future__ import annotations

import dataclasses
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "adding-a-kernel.md").read_text(encoding="utf-8")
STEPS, _, SEPARATELY = DOC.partition("## Tests and documents, separately")
# The files a new kernel touches: the first path of each numbered step.
FILES = re.findall(r"^\d+\. `([^`]+)`", STEPS, re.M)
MAX_FILES = 5

# (module, dotted attribute) of every name the document tells the reader to edit or call.
NAMES = (
    ("kv_canary.codegen.operations", "OPERATIONS"), ("kv_canary.codegen.operations", "Operation"),
    ("kv_canary.codegen.operations", "Keyword"), ("kv_canary.codegen.operations", "TensorRule"),
    ("kv_canary.codegen.operations", "KernelTemplateSpec"),
    ("kv_canary.codegen.operations", "KernelTemplateSpec.source_per_shape"),
    ("kv_canary.codegen.operations", "KernelTemplateSpec.cpu"), ("kv_canary.codegen.operations", "PublicLaunch"),
    ("kv_canary.codegen.operations", "KERNEL_TEMPLATES"), ("kv_canary.codegen.kernel_abi", "Ptr"),
    ("kv_canary.codegen.kernel_abi", "Size"), ("kv_canary.codegen.kernel_abi", "Stride"),
    ("kv_canary.codegen.kernel_abi", "Int"), ("kv_canary.backends.binder", "KernelAbi"),
    ("kv_canary.codegen.operations", "Operation.public"), ("kv_canary.codegen.kernel_abi", "Param"),
    ("kv_canary.codegen.launches", "ROWS"), ("kv_canary.codegen.outputs", "KERNEL_SOURCE_TEMPLATES"),
    ("kv_canary.codegen.cuda_context", "KernelSource"),
    ("kv_canary.launch.operations", "Operation"), ("kv_canary.launch.operations", "BY_NAME"),
    ("kv_canary.launch.operations", "Operation.kernel_launches"), ("kv_canary.launch.operations", "Operation.host_checks"),
    ("kv_canary.launch.operations", "Operation.size_checks"), ("kv_canary.launch.rules", "Rules.check_tensors"),
    ("kv_canary.launch.rules", "Rules.mapping"),
    ("kv_canary.generated.kernel_abi", "OPERATIONS"), ("kv_canary.backends.reference", "Reference"),
)


def _operations():
    from kv_canary.codegen.operations import OPERATIONS
    return OPERATIONS


def test_adding_a_kernel_touches_at_most_five_files_and_each_exists():
    assert 0 < len(FILES) <= MAX_FILES, f"docs/adding-a-kernel.md lists {len(FILES)} files: {FILES}"
    assert len(set(FILES)) == len(FILES)
    with_kernel = [name for name, op in _operations().items() if op.kernel is not None]
    for path in FILES:
        if "<operation>" in path:  # a file per operation: it exists for the operations that have their own
            found = [op for op in with_kernel if (ROOT / path.replace("<operation>", op)).is_file()]
            assert found, f"{path} exists for no operation"
        else:
            assert (ROOT / path).is_file(), path


def test_every_quoted_file_exists():
    paths = {p for p in re.findall(r"`([\w./<>-]+\.(?:py|md|j2|cuh|h|cpp))`", DOC) if "/" in p and "<" not in p}
    assert paths, "the document quotes no file"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"docs/adding-a-kernel.md names files that do not exist: {missing}"
    assert "tests/support/oracle.py" in SEPARATELY and "tests/support/oracle.py" not in FILES


@pytest.mark.parametrize("module,name", NAMES)
def test_every_name_it_tells_to_edit_exists(module, name):
    assert f"`{name.rpartition('.')[2]}" in DOC or f"`{name}" in DOC, f"{name} is no longer in the document"
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)


def test_the_table_derives_what_used_to_be_listed_by_hand():
    """Each operation's entry is enough: its public launches, its CUDA source template (on disk), its
    reference binding, its operation object and its reference function all follow from it."""
    from kv_canary.codegen.launches import ROWS
    from kv_canary.codegen.outputs import KERNEL_SOURCE_TEMPLATES

    import kv_canary
    from kv_canary.backends.reference import Reference
    from kv_canary.launch.operations import BY_NAME
    ops = _operations()
    assert {op for name, op, doc, reference in ROWS} == set(ops)
    assert [name for name, *_ in ROWS] == [p.name for op in ops.values() for p in op.public if p.reference] + \
        [p.name for op in ops.values() for p in op.public if not p.reference]
    assert set(KERNEL_SOURCE_TEMPLATES) == {name for name, op in ops.items() if op.kernel is not None}
    for name, template in KERNEL_SOURCE_TEMPLATES.items():
        for path in (template.values() if isinstance(template, dict) else (template,)):
            assert (ROOT / "codegen" / "templates" / path).is_file(), path
    generated = kv_canary.generated.reference
    for name in ops:
        assert callable(getattr(Reference, name)) and callable(getattr(generated, name)), name
        assert BY_NAME[name].name == name
    assert list(kv_canary.generated.api.LAUNCHES) == [name for name, *_ in ROWS]


def test_an_operation_without_a_cpu_loop_is_left_out_of_the_cpu_library(monkeypatch):
    """`cpu` unset (a new operation): the cpu library has none of its entry points (the cpu backend runs
    its torch reference: tests/backends/test_cpu_backend.py), and the other kernels are unchanged."""
    from kv_canary.codegen.load import load_schema
    from kv_canary.codegen.render import render_all
    schema_path = ROOT / "kernels.yaml"
    schema, text = load_schema(schema_path), schema_path.read_text(encoding="utf-8")

    def cpu_file() -> str:
        return next(f.text for f in render_all(schema, text) if f.path == "cpu/kv_canary_cpu.cpp")
    before = cpu_file()
    assert "kvc_cpu_launch_kvcanary_canary_scatter_req_token_ids(" in before
    ops = _operations()
    monkeypatch.setitem(ops, "scatter", dataclasses.replace(ops["scatter"],
                                                            kernel=dataclasses.replace(ops["scatter"].kernel, cpu=False)))
    after = cpu_file()
    assert "canary_scatter_req_token_ids" not in after and "kvc_cpu::scatter" not in after
    for symbol in ("kvcanary_canary_write(", "kvcanary_canary_verify_check_verify_expected_token(",
                   "kvcanary_canary_plan_offsets(", "kvcanary_canary_plan_entries("):
        assert f"kvc_cpu_launch_{symbol}" in after
