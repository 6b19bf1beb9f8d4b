"""The host-cost benchmarks run where `make gpu-check` cannot be rehearsed: their logic on the CPU.

bench/host_launch.py (launch path vs bare launches, with a byte-for-byte self-check) and
bench/manager_steps.py (the manager's steps on a minimal engine) run on the GPU exactly as here,
with the `cuda` backend instead of `emulated` / `torch`; bench_gpu.py renders their figures, and
scripts/gpu_check.py puts those lines in its summary."""
from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

import kv_canary

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "bench"))

import host_launch  # noqa: E402
import manager_steps  # noqa: E402

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")


def _load(path: Path, name: str):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@needs_gxx
def test_launch_path_and_bare_launches_end_in_the_same_bytes():
    host_launch.self_check(kv_canary.generated, "cpu", "emulated")


@needs_gxx
def test_self_check_notices_a_launch_that_differs(monkeypatch):
    """A bare launch that binds other arguments than the launch path must fail the self-check."""
    bind = host_launch.bare

    def off_by_one(tree, op, args, backend):
        if op == "write":
            args = dict(args, input_ids=args["input_ids"] + 1)
        return bind(tree, op, args, backend)
    monkeypatch.setattr(host_launch, "bare", off_by_one)
    with pytest.raises(AssertionError, match="write through the launch path and as bare launches differ"):
        host_launch.self_check(kv_canary.generated, "cpu", "emulated")


@needs_gxx
def test_host_costs_cover_every_launch():
    costs = host_launch.host_costs(kv_canary.generated, "cpu", "emulated", rounds=1, batch=1)
    assert set(costs) == set(host_launch.LAUNCHES)
    for c in costs.values():
        assert c["launch_us"] > 0 and c["bare_us"] > 0 and c["ratio"] == c["launch_us"] / c["bare_us"]
        assert c["free_us"] > 0 and c["kernel_arguments"] > 0


@needs_gxx
def test_cpu_launch_costs_cover_every_launch_and_backend():
    """bench/bench_host.py's table (make bench): every launch on both host backends, prepared, bare
    and as a free function, in one run."""
    bench = _load(ROOT / "bench" / "bench_host.py", "bench_host_costs")
    rows = bench.launch_costs(["torch", "emulated"], rounds=1, batch=1)
    assert {(r["launch"], r["backend"]) for r in rows} == {(op, b) for op in bench.LAUNCHES for b in ("torch", "emulated")}
    for r in rows:
        assert r["prepared_us"] > 0 and r["bare_us"] > 0 and r["free_us"] > 0
        assert r["ratio_to_bare"] == r["prepared_us"] / r["bare_us"]
    assert len(bench.launch_lines(rows)) == len(rows) + 1


@pytest.mark.parametrize("backend", ["torch", pytest.param("emulated", marks=needs_gxx)])
@pytest.mark.parametrize("kind", ["decode", "prefill"])
def test_manager_steps_run_clean_and_count_their_launches(backend, kind):
    rt = kv_canary.runtime_for(kv_canary.generated)
    clock = manager_steps.KernelClock(rt, backend)
    result = manager_steps.measure(kind, requests=3, tokens=5, steps=2, backend=backend, device="cpu", clock=clock)
    # Per step: the plan (one operation of the reference, two kernels), then HEAD and TAIL each verify
    # and write both halves of the one pool.
    halves = len(kv_canary.generated.layout.LAUNCH_HALVES)
    assert result["launches_per_step"] == (1 if backend == "torch" else 2) + 2 * 2 * halves
    assert 0 < result["in_launch_calls_ms_median"] < result["step_ms_median"]
    assert "host overhead" in manager_steps.describe(result)


def test_gpu_bench_renders_host_figures_into_the_gpu_check_summary():
    bench = _load(ROOT / "bench" / "bench_gpu.py", "bench_gpu_host_lines")
    check = _load(ROOT / "scripts" / "gpu_check.py", "gpu_check_host_lines")
    costs = {op: {"launch_us": 12.0, "bare_us": 10.0, "ratio": 1.2, "kernel_arguments": 43} for op in host_launch.LAUNCHES}
    step = {"kind": "decode", "backend": "cuda", "requests": 256, "tokens": 2048, "steps": 8, "step_ms_best": 0.4,
            "step_ms_median": 0.5, "launches_per_step": 9, "in_launch_calls_ms_median": 0.05,
            "outside_launch_calls_ms_best": 0.3, "outside_launch_calls_ms_median": 0.45}
    result = {"host_launch": bench.host_launch_result(costs), "host_launch_self_check": "ok", "manager_steps": [step],
              "errors": {}}
    result["host_lines"] = bench.host_launch_lines(result)
    assert result["host_launch"]["met"] and result["host_launch"]["worst_ratio"] == 1.2
    text = "\n".join(check.bench_lines(result))
    for line in result["host_lines"]:
        assert f"- {line}" in text
    assert "verify 12.0 us vs 10.0 us (1.20x)" in text and "target <= 2x MET" in text
    assert "256 requests x 2,048 prefix tokens" in text and "9 launches = 56 us per launch" in text
    assert bench.host_launch_result(dict(costs, plan={**costs["plan"], "ratio": 2.5}))["met"] is False


@pytest.mark.parametrize("script", sorted(p.name for p in (Path(__file__).resolve().parents[2] / "bench").glob("bench_*.py")))
def test_every_bench_script_imports_what_it_uses(script):
    """`make bench` runs each script as a program: its module-level imports (the test support
    modules among them) must resolve from a plain interpreter, outside pytest."""
    bench = Path(__file__).resolve().parents[2] / "bench"
    code = ("import runpy, sys; sys.argv = [sys.argv[0]]; "
            f"runpy.run_path({str(bench / script)!r}, run_name='bench_import_check')")
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={k: v for k, v in os.environ.items() if k != "PYTHONPATH"})
    assert proc.returncode == 0, proc.stderr[-2000:]
