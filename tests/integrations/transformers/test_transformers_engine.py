"""kv-canary on HF transformers' continuous batching (kv_canary.integrations.transformers): a clean
run of concurrent requests through chunked prefill and decode is silent and changes no output
token, every fault injected through the engine's own objects is caught at its documented step with
its documented reason and every control stays silent, on the torch reference and the emulated
kernels; the adapter meets the engine contract; a missing hook point fails attach naming the version."""
from __future__ import annotations

from types import SimpleNamespace

import pytest

pytest.importorskip("transformers")

from kv_canary.demo import transformers as tf  # noqa: E402
from kv_canary.engine import contract  # noqa: E402
from kv_canary.engine.manager import CanaryManager  # noqa: E402
from kv_canary.integrations import transformers as kt  # noqa: E402

BACKENDS = ["torch", "cpu", "emulated"]


@pytest.fixture(scope="module")
def unguarded_tokens():
    out = tf.generate(tf.model())
    return {k: list(v.generated_tokens) for k, v in out.items()}


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_run_is_silent_and_changes_no_token(backend, unguarded_tokens):
    canary, out = tf.run_clean(backend=backend)
    m = canary.manager
    assert canary.errors == [] and m.stats.total == 0 and m.violations == []
    assert {k: list(v.generated_tokens) for k, v in out.items()} == unguarded_tokens
    assert len(out) == tf.WORKLOAD.num_requests and all(v.error is None for v in out.values())
    # Every request went through (chunked) prefill and decode, several at once, and the sweep ran.
    assert canary.steps > tf.WORKLOAD.max_new_tokens and m.sweep_passes == canary.steps // tf.SWEEP
    assert m.kernel_runs > 0 and int(m.slot_run_counter[0]) > 0
    assert max(m.stats.by_step, default=0) == 0
    # What the sweep walks: the blocks the ledger keeps for reuse once their requests finished.
    slots, positions, tokens, prevs = canary.engine.cached_entries()
    assert slots and len(slots) == len(positions) == len(tokens) == len(prevs)
    assert len(slots) == len(canary.engine.alloc.ledger.cached_blocks) * canary.engine.block_size


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sc", tf.scenarios(), ids=lambda s: s.name.split("/", 1)[1])
def test_every_fault_is_caught_where_documented_and_every_control_is_silent(sc, backend):
    r = tf.run_scenario(sc, backend=backend)
    assert r.damage_step is not None, f"{sc.name}: the fault never fired"
    assert r.ok, f"{sc.name}: {r.why}"
    if sc.expect.launch is None:
        assert r.violations == 0
    else:
        assert r.first.step == r.damage_step + sc.expect.delay and sc.expect.reason in r.first_launch_reasons


def test_the_adapter_meets_the_engine_contract():
    canary, _ = tf.run(CanaryManager(mode="none"))
    engine = canary.engine
    assert isinstance(engine, contract.BlockTableEngine) and contract.slot_table_kind(engine) == "blocks"
    contract.check_engine(engine)
    pool = engine.canary_pools()["full"]
    assert isinstance(pool.storage, contract.KvStorage)
    # A slot's K bytes in the canary's view are the allocator's own K row of that token.
    alloc = engine.alloc
    physical = 5 * alloc.block_physical_stride + 3
    slot = int(engine.slot_of_physical(__import__("torch").tensor([physical]))[0])
    assert slot == 5 * alloc.tokens_per_page + 3
    k_view = alloc._kv_token_views[alloc.layer_indices[1]][0][physical]   # the allocator's update() target
    row = pool.storage.k[1][slot // pool.storage.row_slots]
    off = (slot % pool.storage.row_slots) * pool.storage.bytes_per_token
    assert row[off:off + pool.storage.bytes_per_token].data_ptr() == k_view.data_ptr()


def test_a_missing_hook_point_fails_attach_naming_the_version(monkeypatch):
    from transformers.generation.continuous_batching import continuous_api
    monkeypatch.delattr(continuous_api.ContinuousBatchProcessor, "update_batch")
    with pytest.raises(RuntimeError) as e:
        kt.attach(tf.model())
    import transformers
    assert f"transformers {transformers.__version__} lacks what the canary hooks into " \
           f"(ContinuousBatchProcessor.update_batch)" in str(e.value)
    assert kt.TESTED_VERSIONS in str(e.value)


def test_unsupported_settings_fail_at_run_start():
    canary = kt.attach(tf.model())
    try:
        gen, cb = tf.WORKLOAD.configs()
        cb.cpu_offload_space = 1.0
        with pytest.raises(ValueError, match="cpu_offload_space=1.0"):
            tf.model().init_continuous_batching(generation_config=gen, continuous_batching_config=cb)
    finally:
        canary.detach()


def test_mode_raise_surfaces_through_check():
    fault = tf.KvBytesChanged()
    canary, out = tf.run(CanaryManager(mode="raise"), hooks=[fault])
    assert fault.fired
    with pytest.raises(Exception, match="verify_real_kv_hash"):
        canary.check()


def test_demo_shows_the_transformers_section(tmp_path, capsys):
    from kv_canary import demo
    rc = demo.main(["--steps", "6", "--out", str(tmp_path), "--only", "out_of_range_slot", "--only", "transformers/clean",
                    "--only", "transformers/kv_bytes_changed", "--only", "transformers/kv_bytes_changed/control"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "real engine: HF transformers" in out and "[ok] transformers/kv_bytes_changed" in out
    assert "violations: 0, output tokens unchanged: yes" in out
    stats = [line.split()[1] for line in out.splitlines() if line.strip().startswith("[canary] step=")]
    assert stats[:2] == ["step=10", "step=20"]   # the stats line on the real engine, every 10 of its steps
    # The first detection's report, as SGLang's runtime logs it (docs/semantics.md §9).
    assert "    kv_canary violation: launch_tag=HEAD_K_FULL fail_reason=verify_real_kv_hash" in out
    assert "    canary_kind:       per_forward_head_k_full" in out
    lines = out.splitlines()
    start = lines.index(next(x for x in lines if x.startswith("scenario ")))
    table = lines[start:]
    assert max(len(line) for line in table[:table.index('')]) <= 120
    report = (tmp_path / "report.md").read_text()
    assert "## Real engine: HF transformers" in report and "transformers/kv_bytes_changed/control" in report


def test_layers_past_what_a_launch_reads_get_the_coverage_warning():
    from kv_canary.engine.manager import CanaryCoverageWarning
    deep = kt.tiny_llama(num_layers=6)
    canary = kt.attach(deep, CanaryManager())
    try:
        with pytest.warns(CanaryCoverageWarning, match="does not cover 2 of 6 full layers"):
            tf.generate(deep, tf.Workload(num_requests=2, max_new_tokens=3))
    finally:
        canary.detach()
    canary.check()
    assert canary.manager.fingerprinted == {"full": (0, 1, 2, 3)} and canary.manager.stats.total == 0


def test_a_persistent_manager_is_guarded_across_sessions_and_detach_removes_every_hook():
    m = tf.model()
    canary = kt.attach(m, CanaryManager())
    gen, cb = tf.WORKLOAD.configs()
    prompts = tf.WORKLOAD.prompts()[:3]
    try:
        for _ in range(2):
            m.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb, persistent_manager=True)
        assert canary.runs == 1 and canary.steps > 0 and canary.manager.stats.total == 0
        canary.check()
        steps = canary.steps
    finally:
        canary.detach()
    cbm = m._cached_continuous_batching_manager
    assert "_create_batch_processor" not in vars(cbm) and "_generation_step" not in vars(cbm.batch_processor)
    m.generate_batch(prompts, generation_config=gen, continuous_batching_config=cb)   # unguarded now
    assert canary.steps == steps


def _isolation_manager(**kwargs):
    from kv_canary.demo.faults import example_tree
    return CanaryManager(tree=example_tree("isolation"), mode="log", backend="torch", **kwargs)


def test_a_schema_with_a_request_input_field_is_refused_at_attach_without_its_function():
    with pytest.raises(ValueError, match=r"request_input field\(s\) cache_namespace need their per-request values"):
        kt.attach(tf.model(), _isolation_manager())
    with pytest.raises(ValueError, match=r"give request_inputs to attach or to the CanaryManager, not both"):
        kt.attach(tf.model(), _isolation_manager(request_inputs=lambda r: {}), request_inputs=lambda s: {})
    assert getattr(tf.model(), "_kv_canary_attachment", None) is None


def test_isolation_schema_through_transformers_prefix_sharing(unguarded_tokens):
    """transformers' block sharing keys on tokens alone: with one namespace for every request the
    isolation schema is silent; with a namespace per request (tenants it does not know about) the
    shared prefix blocks are reported with the namespace reason, and no output token changes."""
    from kv_canary.engine.request_inputs import namespace_inputs, namespace_of
    asked = []

    def in_order(out) -> list:  # request ids go on counting across a process's runs
        return [list(v.generated_tokens) for _, v in sorted(out.items(), key=lambda kv: int(kv[0].split("_")[-1]))]
    unguarded = in_order({k: SimpleNamespace(generated_tokens=v) for k, v in unguarded_tokens.items()})

    def one_tenant(state):
        asked.append(state.request_id)
        return namespace_of("tenant-a")
    canary, out = tf.run_with(_isolation_manager(), request_inputs=namespace_inputs(one_tenant))
    m = canary.manager
    assert canary.errors == [] and m.stats.total == 0 and len(asked) == tf.WORKLOAD.num_requests
    assert in_order(out) == unguarded
    canary, out = tf.run_with(_isolation_manager(),
                              request_inputs=namespace_inputs(lambda state: namespace_of(state.request_id)))
    m = canary.manager
    assert canary.errors == [] and m.stats.total > 0
    # Namespace rows where a request reads another's blocks; the chain folds the namespace, so a block
    # that de-duplication swapped for another namespace's copy also breaks the chain of what follows it.
    assert {r for v in m.violations for r in v.reasons} == {"VERIFY_NAMESPACE_MISMATCH", "VERIFY_CHAIN_HASH_MISMATCH"}
    assert m.violations[0].reasons == ("VERIFY_NAMESPACE_MISMATCH",)
    assert in_order(out) == unguarded


def test_the_attach_guides_snippet_runs_as_written(capsys):
    """docs/attach-your-engine.md's transformers block is complete: it runs as it stands."""
    from pathlib import Path
    doc = (Path(__file__).resolve().parents[3] / "docs" / "attach-your-engine.md").read_text(encoding="utf-8")
    start = doc.index("```python\n", doc.index("## HF transformers: one call")) + len("```python\n")
    exec(compile(doc[start:doc.index("```", start)], "attach-your-engine.md", "exec"), {})
    assert capsys.readouterr().out == "3 requests, 0 violations\n"


def test_metrics_and_the_jsonl_sink_attach_before_the_run(tmp_path):
    """CanaryMetrics and ViolationJsonl made before generate_batch (the adapter attaches the manager
    when the run starts) follow the run; after it the counters equal the manager's totals, no refresh()."""
    import json

    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry

    from kv_canary.engine.jsonl import ViolationJsonl
    from kv_canary.engine.metrics import CanaryMetrics

    manager = CanaryManager(mode="log", sweep_interval=tf.SWEEP)
    registry = CollectorRegistry()
    CanaryMetrics(manager, registry=registry)
    sink = ViolationJsonl(manager, tmp_path / "v.jsonl", labels={"engine": "transformers"})
    fault = tf.KvBytesChanged()
    canary, _ = tf.run(manager, hooks=[fault])
    canary.check()
    sink.close()
    assert fault.fired and manager.stats.total > 0
    value = registry.get_sample_value
    runs = manager.kernel_run_counters.tolist()
    for tag, n in zip(manager.tags, runs):
        assert value("kv_canary_kernel_runs_total", {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0",
                                                     "launch_tag": tag.name}) == n
    assert sum(runs) > 0
    assert value("kv_canary_violation_rows_total", {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}) == \
        manager.stats.total
    objs = [json.loads(line) for line in (tmp_path / "v.jsonl").read_text().splitlines()]
    assert len(objs) == len(manager.violations) and {o["labels"]["engine"] for o in objs} == {"transformers"}
    assert [(o["launch_tag"], o["slot_idx"]) for o in objs] == [(v.launch_tag, v.slot) for v in manager.violations]


def test_the_canarys_tables_follow_the_requests_not_the_cache(unguarded_tokens):
    """A cache 64 times the workload's: the manager's and the adapter's per-request and per-token
    tables are sized by the requests (columns by the longest context, grown on demand), not by the
    cache; the output tokens are unchanged and the run is silent."""
    import dataclasses
    workload = dataclasses.replace(tf.WORKLOAD, num_blocks=64 * tf.WORKLOAD.num_blocks)
    manager = CanaryManager(mode="raise", sweep_interval=tf.SWEEP, initial_context=8)
    model = kt.tiny_llama()    # its own model: a persistent run of the shared one would keep its smaller cache
    canary = kt.attach(model, manager)
    try:
        outputs = tf.generate(model, workload)
    finally:
        canary.detach()
    canary.check()
    engine = canary.engine
    longest = max(len(p) for p in workload.prompts()) + workload.max_new_tokens
    assert manager.max_ctx == workload.num_blocks * tf.PAGE_SIZE            # what the cache would allow
    assert manager.resizes > 0 and longest <= manager.ctx_cols < 4 * longest
    assert manager.req_pool.shape[1] == manager.ctx_cols and manager.token_capacity == 4 * manager.ctx_cols
    assert engine.req_to_block.shape[1] * tf.PAGE_SIZE < 4 * longest + 16 * tf.PAGE_SIZE
    assert manager.stats.total == 0
    def in_order(tokens: dict) -> list:   # request ids count on per model: compare in submission order
        return [tokens[k] for k in sorted(tokens, key=lambda k: int(k.rsplit("_", 1)[1]))]
    assert in_order({k: list(v.generated_tokens) for k, v in outputs.items()}) == in_order(unguarded_tokens)
