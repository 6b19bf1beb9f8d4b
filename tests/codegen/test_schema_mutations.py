"""The schema is the only truth: every mutation either fails generation with a located error, or the
generated tree runs the manager (a clean serving run and a detected fault) without the runtime
assuming anything the schema does not state.

Each mutation edits kernels.yaml's text; trees are generated into this session's scratch cache.
"""
from __future__ import annotations

import re
import warnings
from dataclasses import replace

import pytest
import torch
from kv_canary.codegen.diagnostics import SchemaError
from support.mutations import reason_line, reorder_reasons, sub, tree_of
from support.mutations import reasons as fail_reasons

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine.manager import CanaryCoverageWarning, CanaryManager

torch.set_num_threads(1)

TAG_LINE = re.compile(r"^  ([A-Z_]+): \{value: (\d+), phase: (\w+), half: (\w), group: (\w+)\}$", re.M)
SIM = SimConfig(seed=3, num_pages=40, page_size=4, max_running=4, chunk_size=8, prompt_len=(6, 20),
                output_len=(4, 12), num_system_prompts=2, system_prompt_len=8, swa_window=8)


def add_fields(text: str, fields: list[str], reasons: list[str]) -> str:
    """Append input fields to the canary record (stride grown to fit) and FailReason members."""
    text = sub(r"(      - \{name: \w+, role: kv_fingerprint\}\n)",
               lambda m: m.group(1) + "".join(f"      - {f}\n" for f in fields), text)
    words = 4 + len(fields)
    text = sub(r"^(\s*slot_stride_bytes:\s*)\d+", rf"\g<1>{8 * words}", text)
    last = max(v for _, v, _ in fail_reasons(text))
    extra = "".join(reason_line(name, last << (i + 1), "verify") for i, name in enumerate(reasons))
    return sub(r"(    SLOT_OUT_OF_RANGE: \d+\n)", lambda m: m.group(1) + extra, text)


def rename_tag(text):
    return sub(r"^  SWEEP_V_SWA:", "  SWEEP_V_WINDOWED:", text)


def rename_group(text):
    """The sliding-window group renamed: the engine's `swa` pool is no longer covered (a warning)."""
    return TAG_LINE.sub(lambda m: m.group(0).replace("group: swa", "group: window").replace("_SWA:", "_WINDOW:")
                        if m.group(5) == "swa" else m.group(0), text)


def add_group(text):
    """A third pool group the engine does not have: its tags stay idle."""
    rows = "".join(f"  {p.upper()}_{h.upper()}_MLA: {{value: {100 + i}, phase: {p}, half: {h}, group: mla}}\n"
                   for i, (p, h) in enumerate((p, h) for p in ("head", "tail", "sweep") for h in "kv"))
    return sub(r"(  SWEEP_V_SWA: \{[^\n]*\}\n)", lambda m: m.group(1) + rows, text)


def renumber_tags(text):
    """Tags renumbered and listed in another order."""
    tags = TAG_LINE.findall(text)
    block = "".join(f"  {n}: {{value: {40 - int(v) * 3}, phase: {p}, half: {h}, group: {g}}}\n"
                    for n, v, p, h, g in reversed(tags))
    return sub(r"(^  [A-Z_]+: \{value: \d+, phase: [^\n]*\n)+", lambda m: block, text, count=1)


def rename_fields(text):
    """Every record field renamed (the runtime addresses fields by role and columns by meaning)."""
    for old, new in (("token", "tok"), ("position", "pos"), ("prev_hash", "link"), ("real_kv_hash", "kv_fp")):
        text = sub(rf"\{{name: {old}, role:", f"{{name: {new}, role:", text)
    text = sub(r"fold: \[token, position\]", "fold: [tok, pos]", text)
    for old, new in (("kernel_kind", "tag"), ("slot_idx", "slot"), ("stored_token", "tok_stored")):
        text = sub(rf"\{{name: {old}, carries:", f"{{name: {new}, carries:", text)
    return text


def input_request_id(text):
    return add_fields(text, ["{name: owner, role: input, source: request_id, "
                             "verify: {expected: per_request, fail_reason: OWNER_DIFFERS}}",
                             "{name: writer, role: input, source: request_id}"], ["OWNER_DIFFERS"])


def input_epoch(text):
    return add_fields(text, ["{name: generation, role: input, source: allocation_epoch, "
                             "verify: {expected: per_slot, fail_reason: STALE_GENERATION}}"], ["STALE_GENERATION"])


def input_caller_table(text):
    return add_fields(text, ["{name: tenant, role: input, source: caller_table, "
                             "verify: {expected: per_slot, fail_reason: TENANT_DIFFERS}}"], ["TENANT_DIFFERS"])


def chained_owner_renumbered(text):
    """An input field in the chain fold, with renumbered reasons and renamed fields on top."""
    text = input_request_id(rename_fields(reorder_reasons(text)))
    return sub(r"fold: \[tok, pos\]", "fold: [owner, tok, pos]", text)


RUNNABLE = {
    "rename_tag": rename_tag, "rename_group": rename_group, "add_group": add_group,
    "renumber_tags": renumber_tags, "reorder_reasons": reorder_reasons, "rename_fields": rename_fields,
    "input_request_id": input_request_id, "input_epoch": input_epoch, "input_caller_table": input_caller_table,
    "chained_owner_renumbered": chained_owner_renumbered,
}

REFUSED = {
    # (mutation, the located diagnostic it must produce)
    "request_id_per_slot": (lambda t: add_fields(t, ["{name: owner, role: input, source: request_id, verify: "
                                                     "{expected: per_slot, fail_reason: OWNER_DIFFERS}}"],
                                                 ["OWNER_DIFFERS"]),
                            r"field 'owner' has source 'request_id', which the runtime can only check "
                            r"with expected: per_request"),
    "epoch_per_request": (lambda t: add_fields(t, ["{name: gen, role: input, source: allocation_epoch, verify: "
                                                   "{expected: per_request, fail_reason: GEN_DIFFERS}}"],
                                               ["GEN_DIFFERS"]),
                          r"field 'gen' has source 'allocation_epoch', which the runtime can only check with "
                          r"expected: per_slot"),
    "input_without_source": (lambda t: add_fields(t, ["{name: owner, role: input}"], []),
                             r"field 'owner' of record 'canary' is missing required key 'source'"),
    "tag_missing": (lambda t: sub(r"^  TAIL_V_SWA: [^\n]*\n", "", t),
                    r"pool group 'swa' has no launch tag for tail/v"),
    "group_without_full": (lambda t: t.replace("group: full}", "group: main}"),
                           r"launch_tags must declare group 'full'"),
    "write_kind_for_input_reason": (lambda t: input_epoch(t).replace("STALE_GENERATION: {value: 128, kind: verify}",
                                                                     "STALE_GENERATION: {value: 128, kind: write}"),
                                    r"verify fail_reason 'STALE_GENERATION' has kind 'write'"),
}


def caller_tables(tree, num_slots: int) -> dict:
    """A fixed per-slot table for every caller_table field, per pool group (slot-dependent values)."""
    return {f.name: {g: torch.arange(num_slots, dtype=torch.int64) * 7 + 3 for g in ("full", "swa")}
            for f in tree.layout.INPUT_FIELDS if f.source == "caller_table"}


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_mutation_the_runtime_cannot_serve_fails_generation_with_a_located_error(name):
    mutation, pattern = REFUSED[name]
    with pytest.raises(SchemaError) as info:
        tree_of(mutation)
    assert re.search(r"^kernels\.yaml:\d+:\d+: error: .*" + pattern, str(info.value), re.M), str(info.value)


@pytest.mark.parametrize("name", sorted(RUNNABLE))
def test_mutated_schema_runs_the_manager_and_a_fault_scenario(name):
    """A short serving run on the mutated tree: silent until a double free, which the launch the
    scenario names by coordinates (tail, k, full) catches in the step of the damage."""
    tree = tree_of(RUNNABLE[name])
    L = tree.layout
    sc = replace(next(s for s in faults.scenarios() if s.name == "double_free"), steps=16)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        r = faults.run_scenario(sc, tree=tree, caller_tables=caller_tables(tree, sc.sim.num_slots))
    assert r.damage_step is not None and r.first is not None and r.first.step == r.damage_step, r.why
    assert sum(n for step, n in r.per_step.items() if step < r.damage_step) == 0
    field_reasons = {f.fail_reason for f in L.INPUT_FIELDS if f.fail_reason}
    if field_reasons & set(r.first_launch_reasons):
        # An owner or epoch field sees the page handed out again, possibly already at the HEAD verify.
        assert L.LAUNCH_TAG_COORDINATES[L.CanaryLaunchTag[r.first.launch_tag]] in (("head", "k", "full"),
                                                                                   ("tail", "k", "full"))
    else:
        assert r.ok, r.why
        assert L.LAUNCH_TAG_COORDINATES[L.CanaryLaunchTag[r.first.launch_tag]] == sc.expect.launch
    uncovered = [str(w.message) for w in caught if issubclass(w.category, CanaryCoverageWarning)]
    assert bool(uncovered) == ("swa" not in L.LAUNCH_GROUPS), uncovered


def test_caller_table_is_written_and_checked_per_slot():
    """A caller_table field stores table[slot] at write time and verifies it per slot: a table entry
    that changes under a live slot is reported with the field's own FailReason."""
    tree = tree_of(input_caller_table)
    L = tree.layout
    tables = caller_tables(tree, SIM.num_slots)
    manager = CanaryManager(tree=tree, mode="log", sweep_interval=0, caller_tables=tables)
    engine = Engine(SIM, canary=manager)
    for _ in range(6):
        engine.step()
    manager.drain()
    assert manager.stats.total == 0
    live = next(engine.slot_of(r, 0) for r in engine.running if r.kv_len > 0)
    word = next(f.word for f in L.INPUT_FIELDS if f.name == "tenant")
    g = manager.groups[0]
    assert int(g.bufs["k"].view(torch.int64)[live, word]) == int(tables["tenant"]["full"][live])
    tables["tenant"]["full"][live] += 1                  # the caller's table moves under a live slot
    engine.step()
    manager.drain()
    found = manager.violations
    assert any(v.slot == live and v.has("TENANT_DIFFERS") and v.is_verify for v in found), found[:3]


def test_caller_tables_must_match_the_schema():
    tree = tree_of(input_caller_table)
    with pytest.raises(ValueError, match=r"caller_tables must map exactly the schema's caller_table input fields "
                                         r"\(tenant\)"):
        CanaryManager(tree=tree)
    bad = {"tenant": {"full": torch.zeros(3, dtype=torch.int64), "swa": torch.zeros(3, dtype=torch.int64)}}
    with pytest.raises(ValueError, match=r"caller_tables\['tenant'\]\['full'\] must be an int64 tensor of shape "
                                         rf"\({SIM.num_slots},\) on cpu, got a torch.int64 tensor of shape \(3,\)"):
        Engine(SIM, canary=CanaryManager(tree=tree, caller_tables=bad))
