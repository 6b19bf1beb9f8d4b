"""Tables the generated tree renders from the generator, so that the runtime keeps no copy of them:
what each violation column carries, the "unknown" sentinel, the built-in fail reasons, the plan's
stage arguments and the plan's binding."""
from __future__ import annotations

import random
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from kv_canary.codegen.load import load_schema
from kv_canary.codegen.model import BUILTIN_FAIL_REASONS
from kv_canary.codegen.operations import OPERATIONS, UNKNOWN
from support import scenarios
from support.trees import generate_tree

from kv_canary.engine.violations import ViolationDecoder
from kv_canary.trees.sources import kernel_abi

ROOT = Path(__file__).resolve().parents[2]
SCHEMAS = [ROOT / "kernels.yaml", *sorted((ROOT / "kv_canary" / "schemas").glob("*.yaml"))]


@pytest.fixture(scope="module", params=SCHEMAS, ids=lambda p: p.name)
def generated(request):
    return generate_tree(request.param), load_schema(request.param)


def test_the_trees_carries_are_the_schemas_violation_columns(generated):
    tree, schema = generated
    L = tree.layout
    columns = {f.carries: f.index for f in schema.violation.fields}
    assert sorted(L.VIOLATION_CARRIES) == sorted(columns)
    assert {c: getattr(L, "VIOLATION_COL_" + c.upper()) for c in L.VIOLATION_CARRIES} == columns
    # The decoder reads every column by what it carries: a row of distinct values lands field by field.
    v = ViolationDecoder(L).decode_row([100 + i for i in range(L.VIOLATION_FIELDS)])
    assert (v.launch_tag_value, v.slot, v.position, v.stored_token, v.expected_token, v.stored_chain_hash,
            v.expected_aux, v.reason_bits) == tuple(100 + columns[c] for c in (
                "launch_tag", "slot", "stored_position", "stored_token", "expected_token", "stored_chain_hash",
                "expected_aux", "fail_reason"))


def test_one_unknown_sentinel(generated):
    tree, _ = generated
    header = (Path(tree.__file__).parent / "cuda" / "kv_canary_layout.cuh").read_text(encoding="utf-8")
    # docs/semantics.md §5: -1 = unknown (an expected token not checked, a prev or seed at the chain head).
    assert tree.layout.UNKNOWN == kernel_abi(tree).UNKNOWN == UNKNOWN == -1
    assert "constexpr kvc_i64 UNKNOWN = -1LL;" in header
    assert "INPUT_EXPECTED_UNKNOWN" not in header


def test_builtin_fail_reasons_reach_the_tree(generated):
    tree, _ = generated
    L = tree.layout
    for name, kind, compares_token in BUILTIN_FAIL_REASONS:
        member = L.FailReason[name]
        assert L.FAIL_REASON_KINDS[member] == kind
        assert bool(L.VERIFY_REASON_BITS & member) == (kind == "verify")
        assert bool(L.WRITE_REASON_BITS & member) == (kind == "write")
        assert bool(L.TOKEN_REASON_BITS & member) == compares_token


def test_the_plans_stages_fill_every_field_of_its_plans(generated):
    """PLAN.args (the stage values rendered from the operation table) hands each stage its own keywords, and the
    two stages together reach every field of both plan data classes."""
    tree, schema = generated
    abi = kernel_abi(tree)
    fields = {cls: {name: object() for name, *_ in table}
              for cls, table in (("verify_plan_out", abi.VERIFY_PLAN_FIELDS), ("write_plan_out", abi.WRITE_PLAN_FIELDS))}
    plan = {k.name: object() for k in OPERATIONS["plan"].keywords}
    plan.update({cls: SimpleNamespace(**values) for cls, values in fields.items()},
                extra_request_values={f.name: object() for f in schema.canary.per_request_fields})
    scratch = object()
    stages = abi.PLAN.args(plan, scratch)
    assert [list(s) for s in stages] == [[k.name for k in OPERATIONS[op].keywords] for op in ("plan_offsets", "plan_entries")]
    reached = {id(v) for s in stages for v in s.values()}
    reached |= {id(v) for v in stages[1]["out_extra_verify_expected"].values()}
    assert id(scratch) in reached
    for cls, values in fields.items():
        missing = [name for name, v in values.items() if id(v) not in reached]
        assert not missing, f"the plan's stages never reach {cls}.{missing}"


def test_the_plan_binds_each_stage_as_the_stages_binding_binds_its_arguments(generated):
    """PLAN.bind (what the kernel backends launch a plan with) gives each stage's kernel the values
    its own binding gives over PLAN.args, with and without the optional tensors."""
    tree, _ = generated
    abi = kernel_abi(tree)
    kernels = [abi.kernel_for_operation(stage) for stage in ("plan_offsets", "plan_entries")]
    for seed in range(8):
        case = scenarios.make_plan_case(random.Random(seed), tree, n_reqs=3)
        scratch = torch.zeros(4, dtype=torch.int64)
        stages = abi.PLAN.args(case, scratch)
        assert abi.PLAN.bind(case, scratch) == tuple(k.bind(args) for k, args in zip(kernels, stages))
