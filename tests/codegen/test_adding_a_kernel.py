"""docs/adding-a-kernel.md names only files and names that exist: every file path it quotes, and
every table, class and function it tells the reader to edit or call."""
from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOC = (ROOT / "docs" / "adding-a-kernel.md").read_text(encoding="utf-8")

# (module, dotted attribute) of every name the document tells the reader to edit or call.
NAMES = (
    ("codegen.operations", "OPERATIONS"), ("codegen.operations", "Operation"), ("codegen.operations", "Keyword"),
    ("codegen.operations", "TensorRule"), ("codegen.operations", "KernelTemplateSpec"),
    ("codegen.operations", "KERNEL_TEMPLATES"), ("codegen.kernel_abi", "Ptr"), ("codegen.kernel_abi", "Size"),
    ("codegen.kernel_abi", "Stride"), ("codegen.kernel_abi", "Int"), ("kv_canary.backends.binder", "KernelAbi"),
    ("codegen.launches", "ROWS"), ("codegen.outputs", "KERNEL_SOURCE_TEMPLATES"),
    ("kv_canary.launch.validation", "Validators.check_tensors"), ("kv_canary.launch.validation", "Validators.mapping"),
    ("kv_canary.launch.validation", "Validators._size_checks"), ("kv_canary.launch.operations", "Operation"),
    ("kv_canary.launch.operations", "BY_NAME"), ("kv_canary.launch.operations", "Operation.kernel_launches"),
    ("kv_canary.launch.operations", "Operation.host_checks"),
    ("kv_canary.generated.kernel_abi", "OPERATIONS"), ("kv_canary.generated.kernel_abi", "VERIFY_PLAN_FIELDS"),
    ("kv_canary.generated.kernel_abi", "WRITE_PLAN_FIELDS"), ("kv_canary.backends.reference", "Reference"),
)


def test_every_quoted_file_exists():
    paths = {p for p in re.findall(r"`([\w./-]+\.(?:py|md|j2|cuh|h|cpp))`", DOC) if "/" in p}
    assert paths, "the document quotes no file"
    missing = sorted(p for p in paths if not (ROOT / p).is_file())
    assert not missing, f"docs/adding-a-kernel.md names files that do not exist: {missing}"


@pytest.mark.parametrize("module,name", NAMES)
def test_every_name_it_tells_to_edit_exists(module, name):
    assert f"`{name.rpartition('.')[2]}" in DOC or f"`{name}" in DOC, f"{name} is no longer in the document"
    obj = importlib.import_module(module)
    for part in name.split("."):
        obj = getattr(obj, part)


def test_every_operation_with_a_kernel_has_a_source_template_and_a_launch():
    from codegen.launches import ROWS
    from codegen.operations import OPERATIONS
    from codegen.outputs import KERNEL_SOURCE_TEMPLATES
    with_kernel = {name for name, op in OPERATIONS.items() if op.kernel is not None}
    assert with_kernel == set(KERNEL_SOURCE_TEMPLATES)
    assert {op for _, op, _, _ in ROWS} == set(OPERATIONS)
