"""One-shot GPU check for a machine with an NVIDIA GPU and a system python3 (no virtualenv):
runs the GPU tests (pytest, junit XML) and the GPU benchmarks, and writes summary.md and
results.json into the directory given as the only argument.

Usage: PYTHONPATH=. python3 scripts/gpu_check.py OUT_DIR   (or: make gpu-check OUT=OUT_DIR)

Every step runs in a subprocess with its own time limit; a failing or hanging step is recorded
and the next one still runs, so one run always yields a complete report (< 8 minutes).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

ENV_PROBE = r"""
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}")
except Exception as exc:
    info["torch_error"] = repr(exc)
try:
    import cupy
    from cupy_backends.cuda.libs import nvrtc
    info.update(cupy=cupy.__version__, cupy_available=bool(cupy.is_available()), nvrtc=list(nvrtc.getVersion()))
except Exception as exc:
    info["cupy_error"] = repr(exc)
print(json.dumps(info))
"""

WARM_UP = r"""
import time, torch, kv_canary
from kv_canary.runtime import runtime_for
t = time.perf_counter()
mods = runtime_for(kv_canary.generated).backend("cuda").warm_up("cuda")
print(f"compiled+loaded {len(mods.binaries)} modules for sm_{mods.arch} ({'cubin' if mods.cubin else 'ptx'}) "
      f"in {time.perf_counter() - t:.1f}s; identity checked")
"""


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def run_step(name: str, cmd: list[str], *, timeout: int, out_dir: Path, env: dict) -> dict:
    shown = " ".join(c if "\n" not in c else "<script>" for c in cmd)
    log(f"{name}: {shown} (limit {timeout}s)")
    start = time.perf_counter()
    logfile = out_dir / f"{name}.log"
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        output = (exc.stdout or b"").decode("utf-8", "replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        output += "\n" + ((exc.stderr or b"").decode("utf-8", "replace") if isinstance(exc.stderr, bytes) else (exc.stderr or ""))
        output += f"\n[gpu-check] step timed out after {timeout}s"
    except OSError as exc:
        rc, output = "error", f"[gpu-check] could not start: {exc}"
    seconds = time.perf_counter() - start
    logfile.write_text(output)
    status = "ok" if rc == 0 else "FAILED"
    log(f"{name}: {status} (rc={rc}, {seconds:.1f}s); last lines:\n" + "\n".join(output.strip().splitlines()[-8:]))
    return {"name": name, "rc": rc, "ok": rc == 0, "seconds": round(seconds, 1), "log": logfile.name,
            "tail": output.strip().splitlines()[-25:]}


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        print(__doc__)
        return 2
    out_dir = Path(argv[0]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.setdefault("KV_CANARY_CACHE_DIR", str(out_dir / "cache"))
    py = sys.executable
    started = time.perf_counter()
    steps = [
        run_step("environment", [py, "-c", ENV_PROBE], timeout=60, out_dir=out_dir, env=env),
        run_step("warm_up", [py, "-c", WARM_UP], timeout=90, out_dir=out_dir, env=env),
        run_step("gpu_tests", [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--durations=10",
                               f"--junitxml={out_dir / 'junit_gpu.xml'}", "tests/test_gpu_backend.py"],
                 timeout=240, out_dir=out_dir, env=env),
        run_step("gpu_bench", [py, "bench/bench_gpu.py", "--json", str(out_dir / "bench.json")],
                 timeout=120, out_dir=out_dir, env=env),
    ]
    results = {"steps": steps, "seconds": round(time.perf_counter() - started, 1)}
    try:
        results["environment"] = json.loads(steps[0]["tail"][-1])
    except (IndexError, ValueError):
        results["environment"] = None
    bench_file = out_dir / "bench.json"
    results["bench"] = json.loads(bench_file.read_text()) if bench_file.exists() else None
    (out_dir / "results.json").write_text(json.dumps(results, indent=2))
    (out_dir / "summary.md").write_text(summary(results))
    log(f"done in {results['seconds']}s: " + ", ".join(f"{s['name']}={'ok' if s['ok'] else 'FAILED'}" for s in steps))
    log(f"wrote {out_dir / 'summary.md'} and {out_dir / 'results.json'}")
    return 0 if all(s["ok"] for s in steps) else 1


def summary(results: dict) -> str:
    lines = ["# kv-canary GPU check", ""]
    env = results.get("environment") or {}
    if env:
        lines.append("Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()))
        lines.append("")
    lines += ["| step | result | seconds |", "| --- | --- | --- |"]
    for s in results["steps"]:
        lines.append(f"| {s['name']} | {'ok' if s['ok'] else 'FAILED (rc=' + str(s['rc']) + ')'} | {s['seconds']} |")
    bench = results.get("bench")
    if bench:
        lines += ["", "## Benchmarks", ""]
        copy = bench["copy"]
        lines.append(f"- device-to-device copy of {copy['bytes'] / 1e6:.0f} MB: {copy['ms']:.3f} ms, "
                     f"{copy['bandwidth_read_plus_write_Bps'] / 1e12:.2f} TB/s (read + write)")
        for key in ("verify_persistent", "verify_fixed_grid_64x512"):
            v = bench[key]
            lines.append(f"- {key} (2^20 entries, ALL, 2 x 256 B): {v['ms']:.3f} ms, {v['entries_per_s'] / 1e9:.2f} "
                         f"G entries/s, {v['bytes_per_s'] / 1e12:.2f} TB/s, "
                         f"**{100 * v['ratio_vs_copy_bandwidth']:.0f}% of copy bandwidth** (target 60%)")
        lines.append(f"- write: 32,768-token prefill {bench['write_prefill_32768_ms']:.3f} ms; "
                     f"256 one-token decodes {bench['write_decode_256_ms']:.3f} ms")
        lines.append(f"- plan: 256 requests x 4,096 prefix tokens {bench['plan_256x4096_ms']:.3f} ms")
    for s in results["steps"]:
        if not s["ok"]:
            lines += ["", f"## {s['name']} (failed) — last lines of {s['log']}", "", "```", *s["tail"], "```"]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
