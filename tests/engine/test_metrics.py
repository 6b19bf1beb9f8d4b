"""Prometheus metrics (kv_canary.engine.metrics) through real HTTP scrapes of /metrics on 127.0.0.1, parsed
with prometheus_client's text parser: the counters equal the manager's own totals, during a run and
after it, in one process, in the demo, and in multiprocess mode across the fleet demo's ranks."""
from __future__ import annotations

import logging
import urllib.request
from pathlib import Path

import pytest
import torch

pytest.importorskip("prometheus_client")
from prometheus_client import CollectorRegistry  # noqa: E402
from prometheus_client.parser import text_string_to_metric_families  # noqa: E402

from kv_canary.demo import cli, faults  # noqa: E402
from kv_canary.demo import fleet as fleet_demo  # noqa: E402
from kv_canary.demo.sim import Engine  # noqa: E402
from kv_canary.engine import metrics  # noqa: E402
from kv_canary.engine.manager import CanaryManager  # noqa: E402
from kv_canary.engine.metrics import CanaryMetrics, serve_metrics  # noqa: E402
from kv_canary.engine.violations import sglang_reason_name  # noqa: E402

torch.set_num_threads(1)
SCENARIOS = {sc.name: sc for sc in faults.scenarios()}


def scrape(url: str) -> dict:
    """{(sample name, ((label, value), ...)): value} of one GET of `url`."""
    with urllib.request.urlopen(url, timeout=10) as response:
        text = response.read().decode("utf-8")
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def expected_samples(m: CanaryManager, prefix: str, ranks: dict) -> dict:
    """What the scrape must hold for manager `m`: its own totals, under the rank labels."""
    r = tuple(sorted(ranks.items()))

    def key(name, **labels):
        return f"{prefix}_{name}", tuple(sorted((*r, *labels.items())))
    want = {key("violation_rows_total"): m.stats.total, key("ring_rows_lost_total"): m.stats.lost,
            key("protected_tokens_total"): int(m.slot_run_counter[0]), key("healthy"): 1}
    for tag, n in zip(m.tags, m.kernel_run_counters.tolist()):
        want[key("kernel_runs_total", launch_tag=tag.name)] = n
    for (tag, reason), n in m.stats.by_tag_reason.items():
        want[key("violations_total", launch_tag=tag, fail_reason=sglang_reason_name(reason))] = n
    return want


def assert_scrape_matches(got: dict, want: dict) -> None:
    assert {k: got.get(k) for k in want} == want
    # ... and nothing else of the prefix's violations: no count the manager does not have.
    names = {k[0] for k in want}
    extra = {k: v for k, v in got.items() if k[0] in names and k not in want and not k[0].endswith("_created")}
    assert extra == {}


def test_a_scrape_during_a_run_equals_the_managers_totals(caplog):
    sc = SCENARIOS["late_write/bytes"]
    registry = CollectorRegistry()
    server = serve_metrics(0, registry=registry)
    try:
        # A small ring: some rows are lost, and the lost counter must show them too.
        m = CanaryManager(mode="log", sweep_interval=0, ring_capacity=4)
        engine = Engine(sc.sim, canary=m, hooks=[sc.make_fault()])
        ranks = {"tp_rank": "3", "pp_rank": "1", "dp_rank": "2"}
        CanaryMetrics(m, registry=registry, prefix="fleet_test", tp_rank=3, pp_rank=1, dp_rank=2)
        scrapes = []
        with caplog.at_level(logging.ERROR, logger="kv_canary"):
            for _ in range(24):
                engine.step()
                if m.stats.total and len(scrapes) < 2:   # the first steps with violations
                    scrapes.append((scrape(server.url), expected_samples(m, "fleet_test", ranks)))
        scrapes.append((scrape(server.url), expected_samples(m, "fleet_test", ranks)))
    finally:
        server.close()
    assert m.stats.lost > 0 and len(m.stats.by_tag_reason) > 0 and len(scrapes) == 3
    for got, want in scrapes:
        assert_scrape_matches(got, want)


def test_metrics_made_before_the_engine_attaches_follow_its_run(caplog):
    """An engine integration attaches its manager when a run starts: metrics made before that follow
    the run from its first step, and after it read the manager's totals without a refresh()."""
    sc = SCENARIOS["late_write/bytes"]
    registry = CollectorRegistry()
    m = CanaryManager(mode="log", sweep_interval=0)
    CanaryMetrics(m, registry=registry, prefix="early")
    server = serve_metrics(0, registry=registry)
    try:
        assert scrape(server.url)[("early_kernel_runs_total", (("dp_rank", "0"), ("launch_tag", "HEAD_K_FULL"),
                                                               ("pp_rank", "0"), ("tp_rank", "0")))] == 0
        engine = Engine(sc.sim, canary=m, hooks=[sc.make_fault()])
        with caplog.at_level(logging.ERROR, logger="kv_canary"):
            for _ in range(24):
                engine.step()
            m.flush()
        got = scrape(server.url)
    finally:
        server.close()
    assert m.kernel_runs > 0 and m.stats.total > 0
    assert_scrape_matches(got, expected_samples(m, "early", {"tp_rank": "0", "pp_rank": "0", "dp_rank": "0"}))


def test_bad_arguments_are_named():
    m = CanaryManager(mode="log")
    Engine(faults.BASE, canary=m)
    for kwargs, text in (({"prefix": "9lives"}, "prefix must be a Prometheus metric name"),
                         ({"tp_rank": -1}, "tp_rank must be an int >= 0, got -1"),
                         ({"dp_rank": "0"}, "dp_rank must be an int >= 0, got '0'"),
                         ({"read_every": 0}, "read_every must be an int >= 1, got 0")):
        with pytest.raises(ValueError, match=text):
            CanaryMetrics(m, registry=CollectorRegistry(), **kwargs)
    CanaryMetrics(m, registry=CollectorRegistry())
    with pytest.raises(ValueError, match="already has a CanaryMetrics"):
        CanaryMetrics(m, registry=CollectorRegistry())
    with pytest.raises(ValueError, match=r"port must be an int in \[0, 65535\], got 70000"):
        serve_metrics(70000)


@pytest.fixture
def busy_port():
    """A port another socket is listening on."""
    import socket

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen()
    yield holder.getsockname()[1]
    holder.close()


def test_a_busy_port_is_a_clear_error(busy_port):
    """A bare OSError [Errno 98] named neither the port nor the fix."""
    with pytest.raises(metrics.MetricsPortUnavailable, match=(
            rf"^kv-canary: cannot serve /metrics on 127.0.0.1:{busy_port}: Address already in use; another process "
            rf"is listening there; choose another port \(0 picks a free one\)$")):
        serve_metrics(busy_port, registry=CollectorRegistry())
    assert issubclass(metrics.MetricsPortUnavailable, ValueError)


@pytest.mark.parametrize("world_size", ["1", "2"])
def test_the_demo_on_a_busy_port_is_a_usage_error(busy_port, world_size, tmp_path, monkeypatch, capsys):
    """It was a traceback; the demo now stops before running anything (the fleet: before any rank
    starts, leaving no multiprocess directory behind)."""
    made = []
    real_mkdtemp = fleet_demo.tempfile.mkdtemp
    monkeypatch.setattr(fleet_demo.tempfile, "mkdtemp", lambda **kw: made.append(real_mkdtemp(**kw)) or made[-1])
    with pytest.raises(SystemExit) as exit_:
        cli.main(["--steps", "12", "--out", str(tmp_path), "--world-size", world_size, "--metrics-port", str(busy_port)])
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.splitlines()[-1] == (f"kv-canary demo: error: cannot serve /metrics on 127.0.0.1:{busy_port}: Address "
                                    f"already in use; another process is listening there; choose another port (0 "
                                    f"picks a free one)")
    assert not any(Path(d).exists() for d in made) and not list(tmp_path.iterdir())


def test_the_demo_serves_the_clean_runs_metrics_while_it_runs(tmp_path, monkeypatch, capsys):
    seen = {}
    real_serve, real_clean, real_scenario = metrics.serve_metrics, faults.run_clean, faults.run_scenario

    def serve(*args, **kwargs):
        seen["server"] = real_serve(*args, **kwargs)
        return seen["server"]

    def clean(*args, **kwargs):
        seen["engine"], seen["manager"] = real_clean(*args, **kwargs)
        return seen["engine"], seen["manager"]

    def scenario(*args, **kwargs):   # the demo is still running: the clean run's metrics are served
        if "scrape" not in seen:
            seen["scrape"] = scrape(seen["server"].url)
        return real_scenario(*args, **kwargs)

    monkeypatch.setattr(metrics, "serve_metrics", serve)
    monkeypatch.setattr(faults, "run_clean", clean)
    monkeypatch.setattr(faults, "run_scenario", scenario)
    rc = cli.main(["--steps", "12", "--out", str(tmp_path), "--only", "out_of_range_slot", "--metrics-port", "0"])
    out = capsys.readouterr().out
    assert rc == 0 and f"serving the Prometheus metrics of every run (label scenario) on {seen['server'].url}" in out
    m = seen["manager"]
    assert m.kernel_runs > 0
    assert_scrape_matches(seen["scrape"], expected_samples(m, "kv_canary", {"tp_rank": "0", "pp_rank": "0",
                                                                           "dp_rank": "0", "scenario": "clean"}))
    with pytest.raises(OSError):   # stopped with the demo
        scrape(seen["server"].url)


@pytest.mark.parametrize("mode", ["log", "raise"])
def test_the_fleet_demo_serves_every_ranks_metrics_in_multiprocess_mode(mode, tmp_path, monkeypatch, capsys):
    seen = {}
    real_serve, real_report = metrics.serve_metrics, fleet_demo.report

    def serve(*args, **kwargs):
        seen["server"] = real_serve(*args, **kwargs)
        return seen["server"]

    def report(demo, ranks, *args, **kwargs):   # the ranks are done; the demo still serves
        seen["scrape"], seen["ranks"] = scrape(seen["server"].url), ranks
        return real_report(demo, ranks, *args, **kwargs)

    monkeypatch.setattr(metrics, "serve_metrics", serve)
    monkeypatch.setattr(fleet_demo, "report", report)
    rc = cli.main(["--world-size", "2", "--steps", "12", "--out", str(tmp_path), "--kv-canary", mode,
                   "--metrics-port", "0"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "fleet behaved as documented: rank 1's violations at step 8 were acted on by every rank at step 9" in out
    assert (tmp_path / "fleet_report.md").read_text().count("every rank holds the same decisions: yes") == 1
    got = seen["scrape"]
    for r in seen["ranks"]:
        labels = (("dp_rank", "0"), ("pp_rank", "0"), ("tp_rank", str(r["rank"])))
        t = r["totals"]
        assert got[("kv_canary_violation_rows_total", labels)] == t["rows"]
        assert got[("kv_canary_protected_tokens_total", labels)] == t["protected_tokens"] > 0
        assert got[("kv_canary_healthy", labels)] == 1
        for tag, n in t["kernel_runs"].items():
            assert got[("kv_canary_kernel_runs_total", tuple(sorted((*labels, ("launch_tag", tag)))))] == n
        by_tag_reason = {k[1]: v for k, v in got.items() if k[0] == "kv_canary_violations_total"
                         and dict(k[1])["tp_rank"] == str(r["rank"])}
        assert by_tag_reason == {tuple(sorted((*labels, ("launch_tag", tag), ("fail_reason", sglang_reason_name(rs)))))
                                 : n for (tag, rs), n in t["by_tag_reason"].items()}
    assert seen["ranks"][1]["totals"]["rows"] > 0 and seen["ranks"][0]["totals"]["rows"] == 0
