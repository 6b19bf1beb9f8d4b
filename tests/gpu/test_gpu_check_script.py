"""scripts/gpu_check.py and bench/bench_gpu.py on a machine without a GPU: the script must run end
to end (environment probe, report files, clear exit status) so that the one run on a GPU machine
is not wasted on a script error; and its summary must carry every figure of the GPU benchmarks."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _gpu_visible() -> bool:
    import torch
    return torch.cuda.is_available()


@pytest.mark.skipif(_gpu_visible(), reason="a GPU is visible: make gpu-check runs the real thing")
def test_script_without_gpu_reports_not_run_and_exits_3(tmp_path):
    out = tmp_path / "out"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("KV_CANARY_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py", str(out)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3, proc.stdout + proc.stderr
    assert "NO GPU" in proc.stdout
    files = sorted(p.name for p in out.iterdir())
    assert files == ["environment.log", "results.json", "summary.md"]  # flat, few files, no cache inside
    results = json.loads((out / "results.json").read_text())
    assert [s["name"] for s in results["steps"]] == ["environment", "warm_up", "gpu_bench", "gpu_tests", "sglang_plugin"]
    assert [s["status"] for s in results["steps"]] == ["ok", "not run", "not run", "not run", "not run"]
    assert results["environment"]["python"] == sys.version.split()[0]
    assert not Path(results["cache_dir"]).resolve().is_relative_to(out.resolve())
    summary = (out / "summary.md").read_text()
    assert "NOT RUN: no GPU visible" in summary and "| gpu_tests | not run |" in summary


def test_script_usage_error_without_out_dir():
    proc = subprocess.run([sys.executable, "scripts/gpu_check.py"], cwd=ROOT, capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2 and "Usage" in proc.stdout


@pytest.mark.skipif(_gpu_visible(), reason="a GPU is visible")
def test_bench_without_gpu_exits_2_when_required():
    proc = subprocess.run([sys.executable, "bench/bench_gpu.py", "--require-gpu"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 2 and "skipped" in proc.stdout, proc.stdout + proc.stderr


def _bench_results(bench, *, copy_ms: float, verify_ms: float, fixed_ms: float) -> dict:
    """A bench result dict in the shape bench_gpu.bench() builds, from its own helpers."""
    nbytes = bench.ENTRIES * 600
    copy = {"bytes": nbytes, "ms": copy_ms, "bandwidth_read_plus_write_Bps": 2 * nbytes / (copy_ms * 1e-3)}
    persistent = bench._verify_result(verify_ms, nbytes, copy, 0, host_us=80.0)
    fixed = bench._verify_result(fixed_ms, nbytes, copy, 0, host_us=80.0)
    ratio = persistent["ratio_vs_copy_bandwidth"]
    return {"device": "test", "entries": bench.ENTRIES, "verify_bytes_per_entry": 600, "copy": copy,
            "verify_grid": {"blocks": 660, "threads": 256, "sm_count": 132, "schema_blocks_per_sm": 8,
                            "resident_blocks_per_sm": 5, "num_regs": 48, "shared_size_bytes": 36864,
                            "arch": 90, "binary": "cubin"},
            "verify_persistent": persistent, "verify_fixed_grid_64x512": fixed,
            "persistent_vs_fixed_grid_speedup": fixed_ms / verify_ms,
            "verify_target": {"ratio": ratio, "target": bench.TARGET_RATIO, "met": ratio >= bench.TARGET_RATIO},
            "write_launch": {"shape": "block_per_request", "threads": 256},
            "write_prefill_32768_ms": 1.5, "write_prefill_32768_per_request_ms": 90.0,
            "write_prefill_speedup_vs_per_request": 60.0, "chain_only_32768_ms": 1.25,
            "write_prefill_vs_chain_only": 1.5 / 1.25,
            "write_target": {"ratio": 1.5 / 1.25, "target": bench.WRITE_TARGET_RATIO, "met": 1.5 / 1.25 <= bench.WRITE_TARGET_RATIO},
            "write_decode_256_ms": 0.02, "plan_256x4096_ms": 0.05, "errors": {}}


@pytest.mark.parametrize("verify_ms,met", [(0.24, True), (0.5, False)])
def test_summary_reports_every_figure_and_the_target(verify_ms, met):
    bench = _load(ROOT / "bench" / "bench_gpu.py", "bench_gpu_under_test")
    check = _load(ROOT / "scripts" / "gpu_check.py", "gpu_check_under_test")
    # copy 0.3 ms of 2 x N bytes; verify of N bytes in 0.24 ms = 62.5% of it, in 0.5 ms = 30%.
    results = {"steps": [{"name": n, "status": "ok", "rc": 0, "seconds": 1.0, "log": f"{n}.log", "tail": []}
                         for n, _ in check.STEPS],
               "environment": {"python": "3.12"},
               "bench": _bench_results(bench, copy_ms=0.3, verify_ms=verify_ms, fixed_ms=0.6)}
    results["verdict"] = check.verdict(results, "")
    text = check.summary(results)
    assert results["verdict"]["text"].startswith("PASS")
    assert ("target MET" in text) == met and ("target NOT MET" in text) == (not met)
    for figure in ("G entries/s", "TB/s", "of copy bandwidth", "SGLang's 64 x 512", "32,768-token prefill",
                   "256 one-token decodes", "256 requests x 4,096 prefix tokens", "resident"):
        assert figure in text, figure
    assert f"{0.6 / verify_ms:.2f}x" in text
    assert "n/a" not in text
    # The bench's own report renders the same dict.
    assert ("MET" in bench.report(results["bench"])) and "ERROR" not in bench.report(results["bench"])
    # ... and names the write launch shape it measured, with SGLang's per_request shape beside it.
    assert "write (block_per_request, 256 threads)" in bench.report(results["bench"])
    assert "per_request shape (one thread per request): 90.000 ms (60.0x slower)" in bench.report(results["bench"])
    # ... and the prefill write against its chain alone (1.5 ms / 1.25 ms), in both.
    for lines in (text, bench.report(results["bench"])):
        assert "1.250 ms; write / chain only" in lines and "1.20x" in lines and "target <= 1.3x: met" in lines


def test_summary_names_failed_steps_and_missing_bench():
    check = _load(ROOT / "scripts" / "gpu_check.py", "gpu_check_under_test")
    results = {"steps": [{"name": "environment", "status": "ok", "rc": 0, "seconds": 1.0, "log": "environment.log",
                          "tail": []},
                         {"name": "gpu_tests", "status": "failed", "rc": "timeout", "seconds": 210.0,
                          "log": "gpu_tests.log", "tail": ["[gpu-check] step timed out after 210s"]}],
               "environment": {"cuda_available": True}, "bench": None}
    results["verdict"] = check.verdict(results, "")
    text = check.summary(results)
    assert "FAIL: step(s) gpu_tests" in text and "UNKNOWN" in text
    assert "FAILED (rc=timeout)" in text and "step timed out after 210s" in text



def test_the_gpu_tests_step_runs_every_gpu_test_file():
    """Every test file that must not skip on the GPU machine (it honours KV_CANARY_REQUIRE_GPU, which
    the script sets) is in the gpu_tests step, the fleet's NCCL test included."""
    check = _load(ROOT / "scripts" / "gpu_check.py", "gpu_check_under_test")
    files = sorted(str(p.relative_to(ROOT)) for p in (ROOT / "tests").rglob("test_*.py")
                   if p.name != Path(__file__).name and "KV_CANARY_REQUIRE_GPU" in p.read_text(encoding="utf-8"))
    assert "tests/gpu/test_gpu_fleet.py" in files
    assert sorted(check.GPU_TESTS) == files
    command = check.step_command("gpu_tests", "python3", Path("/tmp/out"), Path("/tmp/bench.json"))
    assert [c for c in command if c.startswith("tests/")] == list(check.GPU_TESTS)
