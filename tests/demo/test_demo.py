"""`kv-canary demo` end to end on a shortened run."""
from __future__ import annotations

import pytest

from kv_canary import demo


def test_demo_writes_table_and_report(tmp_path, capsys):
    rc = demo.main(["--steps", "12", "--out", str(tmp_path), "--only", "out_of_range_slot",
                    "--only", "stale_transfer/default_schema"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "scenario" in out and "first detection (damage step)" in out and "first decoded line" not in out
    assert "\r" not in out and "scenario 1/" not in out  # not a terminal: no progress lines to overwrite
    lines = out.splitlines()
    table = lines[lines.index(next(x for x in lines if x.startswith("scenario "))):]
    assert "[ok] out_of_range_slot" in out and max(len(line) for line in table[:table.index('')]) <= 120
    i = next(k for k, line in enumerate(lines) if line.startswith("[ok] stale_transfer/default_schema"))
    assert lines[i].split() == ["[ok]", "stale_transfer/default_schema", "defaults", "0", "-"]
    assert lines[i + 1].strip() == "expected: not detected (control); detected by: not detected"
    report = (tmp_path / "report.md").read_text()
    assert "## Scenarios" in report and "stale_transfer/default_schema" in report
    assert "first decoded line" in report and "launch_tag=HEAD_K_FULL fail_reason=slot_out_of_range" in report
    # The control runs with every default check on, and the report says so.
    details = report.split("### stale_transfer/default_schema", 1)[1]
    assert "- canary: schema kernels.yaml, expected-token check on, real-KV fingerprint ALL" in details
    png = (tmp_path / "violations_per_step.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


def test_progress_lines_are_shown_on_a_terminal_only(tmp_path, monkeypatch):
    """On a terminal the clean run's progress and each scenario's name overwrite each other (\\r);
    the table then starts on a line of its own."""
    import io
    import sys

    class Terminal(io.StringIO):
        def isatty(self):
            return True
    terminal = Terminal()
    monkeypatch.setattr(sys, "stdout", terminal)
    assert demo.main(["--steps", "40", "--out", str(tmp_path), "--only", "out_of_range_slot"]) == 0
    out = terminal.getvalue()
    assert "\r  clean run: step 20/40\r  clean run: step 40/40\n" in out
    assert "\r  scenario 1/1: out_of_range_slot" in out
    assert "\n\nscenario " in out


def test_demo_rejects_unknown_scenario(tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo.main(["--out", str(tmp_path), "--only", "nope"])
    assert "--only must name scenarios from" in capsys.readouterr().err


def test_demo_takes_sglangs_flags_and_shows_the_stats_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SGLANG_KV_CANARY_STATS_PRINT_EVERY_N_STEPS", "5")
    rc = demo.main(["--steps", "12", "--out", str(tmp_path), "--only", "out_of_range_slot", "--kv-canary", "raise",
                    "--kv-canary-real-data", "partial", "--kv-canary-sweep-interval", "4"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "canary: --kv-canary raise --kv-canary-real-data partial --kv-canary-sweep-interval 4, " \
           "stats line every 5 steps" in out
    stats = [line.strip("\r ").split()[:2] for line in out.splitlines() if "[canary]" in line]
    assert stats == [["[canary]", "step=5"], ["[canary]", "step=10"]]


@pytest.mark.parametrize("argv, message", [
    (["--kv-canary", "none", "--kv-canary-sweep-interval", "4"],
     "--kv-canary-sweep-interval requires --kv-canary in {log, raise}"),
    (["--kv-canary", "loud"], "--kv-canary must be one of none, log, raise"),
])
def test_demo_refuses_bad_canary_flags(argv, message, tmp_path, capsys):
    with pytest.raises(SystemExit):
        demo.main(["--out", str(tmp_path), *argv])
    assert message in capsys.readouterr().err


def test_sglang_mode_flag_alone_follows_sglangs_defaults(tmp_path, capsys):
    rc = demo.main(["--steps", "101", "--out", str(tmp_path), "--only", "out_of_range_slot", "--kv-canary", "log"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "--kv-canary log --kv-canary-real-data none --kv-canary-sweep-interval 0, stats line every 100 steps" in out
    assert [line.strip("\r ").split()[1] for line in out.splitlines() if "[canary] step=" in line] == ["step=100"]


def test_scenarios_say_they_run_their_own_canary_not_the_flags(tmp_path, capsys):
    """The flags set the clean run only: the bit flip is found although they leave the real-KV fingerprint off."""
    rc = demo.main(["--steps", "6", "--out", str(tmp_path), "--only", "cold_page_bit_flip", "--kv-canary", "raise"])
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "canary: --kv-canary raise --kv-canary-real-data none" in out and "[ok] cold_page_bit_flip" in out
    assert "fault scenarios: each runs its own canary in mode log, not the flags above; canary 'defaults': " \
           "real-KV ALL, expected-token check on" in out


@pytest.mark.parametrize("flags, rc, verdict", [
    # SGLang's defaults, once a canary flag is given, leave the real-KV fingerprint off: nothing can see the flip.
    (["--kv-canary", "raise"], 1,
     "NOT DETECTABLE WITH THESE CANARY OPTIONS: cold_page_bit_flip shows as VERIFY_REAL_KV_HASH_MISMATCH; it needs "
     "the real-KV fingerprint (--kv-canary-real-data partial or all), which these canary options leave off "
     "(--kv-canary-real-data none). Rank 1's fault went unseen, so no rank had a violation to act on"),
    (["--kv-canary", "raise", "--kv-canary-real-data", "partial"], 0,
     "fleet behaved as documented: rank 1's violations at step 17 were acted on by every rank at step 18"),
])
def test_the_fleet_demo_says_when_the_options_cannot_see_the_fault(flags, rc, verdict, tmp_path, capsys):
    got = demo.main(["--world-size", "2", "--steps", "24", "--out", str(tmp_path), "--only", "cold_page_bit_flip",
                     *flags])
    out = capsys.readouterr().out
    assert got == rc, out
    assert verdict in out and f"**{verdict}" in (tmp_path / "fleet_report.md").read_text()
    assert "FLEET DEMO FAILED" not in out


def test_without_matplotlib_the_report_says_why(tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "matplotlib", None)   # import matplotlib -> ImportError
    rc = demo.main(["--steps", "6", "--out", str(tmp_path), "--only", "out_of_range_slot"])
    out = capsys.readouterr().out
    assert rc == 0 and "no chart: matplotlib is not installed: pip install 'kv-canary[demo]'" in out
    assert "(no chart: matplotlib is not installed" in (tmp_path / "report.md").read_text()
    assert not (tmp_path / "violations_per_step.png").exists()


def test_metrics_serve_every_scenario(tmp_path, capsys):
    pytest.importorskip("prometheus_client")
    from prometheus_client import CollectorRegistry, generate_latest

    from kv_canary.demo import faults
    registry = CollectorRegistry()
    faults.run_clean(6, metrics_registry=registry)
    sc = next(s for s in faults.scenarios() if s.name == "out_of_range_slot")
    faults.run_scenario(sc, metrics_registry=registry)
    text = generate_latest(registry).decode()
    assert 'scenario="clean"' in text
    rows = [line for line in text.splitlines() if line.startswith("kv_canary_violation_rows_total")]
    bad = [line for line in rows if 'scenario="out_of_range_slot"' in line]
    assert bad and float(bad[0].split()[-1]) > 0


def test_without_transformers_the_section_says_how_to_get_it(tmp_path, capsys, monkeypatch):
    import sys
    monkeypatch.setitem(sys.modules, "transformers", None)   # import transformers -> ImportError
    rc = demo.main(["--steps", "6", "--out", str(tmp_path), "--only", "out_of_range_slot",
                    "--only", "transformers/clean"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "skipped: HF transformers is not installed: pip install 'kv-canary[transformers]' (or `make setup`)" in out
    assert "Skipped: HF transformers is not installed" in (tmp_path / "report.md").read_text()


@pytest.mark.parametrize("argv, message", [
    (["--backend", "cdua"], "--backend must be one of torch, cpu, cuda, emulated, got 'cdua' (did you mean 'cuda'?)"),
    (["--device", "tpu"], "--device must be a torch device such as cpu or cuda, got 'tpu'"),
    (["--out", "/proc/nope/x"], "--out /proc/nope/x: cannot write the report there"),
])
def test_demo_arguments_are_checked_before_anything_runs(argv, message, tmp_path, capsys, monkeypatch):
    """A typo ends in an argparse error (exit 2) before the clean run starts, not in a traceback after it."""
    from kv_canary.demo import faults
    monkeypatch.setattr(faults, "run_clean", lambda *a, **k: pytest.fail("the clean run started"))
    argv = argv if "--out" in argv else ["--out", str(tmp_path), *argv]
    with pytest.raises(SystemExit) as exc:
        demo.main(argv)
    assert exc.value.code == 2
    assert message in capsys.readouterr().err


def test_demo_on_cuda_without_a_gpu_says_so(tmp_path, capsys, monkeypatch):
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    for argv in (["--device", "cuda"], ["--backend", "cuda"]):
        with pytest.raises(SystemExit) as exc:
            demo.main(["--out", str(tmp_path), *argv])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "cuda" in err and ("use --device cpu" in err or "use torch or emulated" in err)


def test_the_chart_has_one_row_per_scenario_controls_last(tmp_path):
    """The chart is one glance: a row per scenario (steps across), the latency beside each detected
    one, the controls grouped after them and said to be silent."""
    from PIL import Image

    from kv_canary.demo import faults, report
    chosen = {s.name: s for s in faults.scenarios()}
    runs = [faults.run_scenario(chosen[name]) for name in
            ("stale_transfer/default_schema", "out_of_range_slot", "wrong_token_at_chunk_boundary")]
    rows = report.chart_rows(runs)
    assert [r.label for r in rows] == ["out_of_range_slot", "wrong_token_at_chunk_boundary",
                                       "stale_transfer/default_schema"]
    assert [r.control for r in rows] == [False, False, True]
    for r, run in zip(rows, [runs[1], runs[2], runs[0]]):
        assert len(r.counts) == run.scenario.steps and sum(r.counts) == run.violations
    late = runs[2].first.step - runs[2].damage_step
    assert late == runs[2].scenario.expect.delay == 1
    assert rows[0].note == "detected, latency 0 steps" and rows[1].note == "detected, latency 1 step"
    assert rows[2].note == "silent" and rows[2].damage_step is not None
    png = report.write_chart(runs, tmp_path / "chart.png")
    width, height = Image.open(png).size
    assert width > height   # one panel, rows stacked, not a grid of small panels


def test_demo_writes_every_violation_as_a_json_line(tmp_path, capsys):
    import json
    target = tmp_path / "v.jsonl"
    rc = demo.main(["--steps", "12", "--out", str(tmp_path), "--only", "out_of_range_slot",
                    "--only", "stale_transfer/default_schema", "--violations-jsonl", str(target)])
    out = capsys.readouterr().out
    assert rc == 0 and f"violations as JSON lines: {target}" in out
    objs = [json.loads(line) for line in target.read_text().splitlines()]
    by_scenario = {}
    for o in objs:
        by_scenario.setdefault(o["labels"]["scenario"], []).append(o)
    assert set(by_scenario) == {"out_of_range_slot"}   # the clean run and the control are silent
    row = next(line for line in out.splitlines() if line.startswith("[ok] out_of_range_slot"))
    assert len(by_scenario["out_of_range_slot"]) == int(row.split()[3])
    assert "slot_out_of_range" in {o["fail_reason"] for o in objs}
    with pytest.raises(SystemExit):
        demo.main(["--out", str(tmp_path), "--violations-jsonl", str(tmp_path), "--steps", "1"])
    assert "--violations-jsonl" in capsys.readouterr().err
