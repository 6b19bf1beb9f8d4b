"""`kv-canary demo` end to end on a shortened run."""
from __future__ import annotations

import pytest

from kv_canary import demo


def test_demo_writes_table_and_report(tmp_path, capsys):
    rc = demo.main(["--steps", "12", "--out", str(tmp_path), "--only", "out_of_range_slot",
                    "--only", "stale_transfer/default_schema"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "scenario" in out and "expected detection" in out and "first decoded line" in out
    assert "[ok] out_of_range_slot" in out and "launch_tag=HEAD_K_FULL fail_reason=slot_out_of_range" in out
    control = next(line for line in out.splitlines() if line.startswith("[ok] stale_transfer/default_schema"))
    assert control.split()[:4] == ["[ok]", "stale_transfer/default_schema", "defaults", "not"]
    report = (tmp_path / "report.md").read_text()
    assert "## Scenarios" in report and "stale_transfer/default_schema" in report
    # The control runs with every default check on, and the report says so.
    details = report.split("### stale_transfer/default_schema", 1)[1]
    assert "- canary: schema kernels.yaml, expected-token check on, real-KV fingerprint ALL" in details
    png = (tmp_path / "violations_per_step.png").read_bytes()
    assert png.startswith(b"\x89PNG") and len(png) > 1000


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
