"""The operation table: every tensor a kernel reads or writes has a validation rule, and the rules
are well formed (a size is bound before it is matched, names are unique)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from codegen.load import load_schema
from codegen.operations import OPERATIONS, ROLES, binding_forms, kernel_params

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = [ROOT / "kernels.yaml", *sorted((ROOT / "kv_canary" / "schemas").glob("*.yaml"))]


@pytest.fixture(scope="module", params=SCHEMAS, ids=lambda p: p.name)
def schema(request):
    return load_schema(request.param)


@pytest.mark.parametrize("operation", sorted(name for name, op in OPERATIONS.items() if op.kernel is not None))
def test_every_tensor_parameter_has_a_rule(schema, operation):
    kernel = next(k for k in schema.kernels if k.operation == operation)
    paths = {r.path for r in OPERATIONS[operation].tensors(schema)}
    for p in kernel_params(schema, kernel):
        if p.is_pointer and not p.address:
            value = re.sub(r" if .* else None$", "", p.value)
            assert value in paths, f"{operation}: kernel parameter {p.name} reads {value}, which no rule checks"


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
    roots = {re.match(r"(?:getattr\()?(\w+)", r.path).group(1) for r in rules}
    assert roots <= keywords, f"{operation}: rules reach {roots - keywords}, which are not its keywords"


def test_binding_passes_unchecked_only_what_cannot_overflow(schema):
    for kernel in schema.kernels:
        for p, form in zip(kernel.params, binding_forms(schema, kernel)):
            assert form in ("address", "ptr", "nullable", "size", "fits", "checked")
            if form == "size":
                assert p.kind == "i64" or p.name == "real_kv_num_sources", f"{kernel.name}.{p.name}: a {p.ctype} size"
