"""The operation table: every tensor a kernel reads or writes has a validation rule, and the rules
are well formed (a size is bound before it is matched, names are unique)."""
from __future__ import annotations

from pathlib import Path

import pytest

from codegen.kernel_abi import Int, Ptr, RealKvCount, RealKvPart, Size, Stride
from codegen.load import load_schema
from codegen.operations import OPERATIONS, ROLES, argument_kinds, checked_by_validation, kernel_params

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = [ROOT / "kernels.yaml", *sorted((ROOT / "kv_canary" / "schemas").glob("*.yaml"))]


@pytest.fixture(scope="module", params=SCHEMAS, ids=lambda p: p.name)
def schema(request):
    return load_schema(request.param)


def _root(path: str) -> str:
    return path.partition("[")[0].split(".")[0]


@pytest.mark.parametrize("operation", sorted(name for name, op in OPERATIONS.items() if op.kernel is not None))
def test_every_tensor_parameter_has_a_rule(schema, operation):
    """A kernel's pointer reads a tensor some rule checks, and a pointer the binding takes as required
    (data_ptr() without a None check) has a required rule."""
    kernel = next(k for k in schema.kernels if k.operation == operation)
    rules = {r.path: r for r in OPERATIONS[operation].tensors(schema)}
    for p in kernel_params(schema, kernel):
        if isinstance(p.source, Ptr):
            assert p.source.path in rules, f"{operation}: kernel parameter {p.name} reads {p.source.path}, which no rule checks"
            assert p.source.optional or not rules[p.source.path].optional, f"{operation}: {p.name} is optional"


@pytest.mark.parametrize("operation", sorted(name for name, op in OPERATIONS.items() if op.kernel is not None))
def test_every_parameter_reads_the_operation_arguments(schema, operation):
    """Each value source starts from an argument of the operation (the binder reads `arguments[root]`)."""
    kernel = next(k for k in schema.kernels if k.operation == operation)
    keywords = {k.name for k in OPERATIONS[operation].keywords}
    for p in kernel_params(schema, kernel):
        src = p.source
        assert isinstance(src, (Ptr, Size, Stride, Int, RealKvPart, RealKvCount)), (p.name, src)
        paths = ((src.path, src.when) if isinstance(src, Ptr) and src.when else
                 ("context.real_kv_sources",) if isinstance(src, RealKvPart) else (src.path,))
        for path in paths:
            assert _root(path) in keywords, f"{operation}: {p.name} reads {path}, not an argument of the operation"


@pytest.mark.parametrize("operation", sorted(OPERATIONS))
def test_rules_are_well_formed(schema, operation):
    op = OPERATIONS[operation]
    rules = op.tensors(schema)
    assert rules[0].name == op.device_of and not rules[0].optional
    assert len({r.name for r in rules}) == len(rules)
    bound: set = set()
    for r in rules:
        assert r.role in ROLES
        for d in r.dims:
            if isinstance(d, str):
                symbol, plus, _ = d.partition("+")
                assert not plus or symbol in bound, f"{operation}: {r.name} matches {d} before a rule binds {symbol}"
                assert not (r.optional and symbol not in bound), f"{operation}: optional {r.name} binds {symbol}"
                bound.add(symbol)
    keywords = {k.name for k in op.keywords}
    roots = {_root(r.path) for r in rules}
    assert roots <= keywords, f"{operation}: rules reach {roots - keywords}, which are not its keywords"


def test_binding_passes_unchecked_only_what_validation_range_checks(schema):
    """An integer parameter passes unchecked only when validation refuses its argument outside the
    parameter's C type (argument_kinds); a launch tag or hash mode read from an object is checked."""
    kinds = argument_kinds(schema)
    for kernel in schema.kernels:
        for p in kernel.params:
            if isinstance(p.source, Int) and checked_by_validation(p, kinds):
                assert p.source.argument in kinds and (kinds[p.source.argument], p.kind) in (
                    ("i32", "i32"), ("i32", "i64"), ("i64", "i64")), f"{kernel.name}.{p.name}"
            if p.name in ("launch_tag", "real_kv_hash_mode"):
                assert not checked_by_validation(p, kinds), f"{kernel.name}.{p.name} must be range-checked when bound"
