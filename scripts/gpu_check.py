"""One-shot GPU check for a machine with an NVIDIA GPU and a system python3 (no virtualenv, nothing
to install): probes the environment, compiles and loads the kernels, runs the GPU benchmarks and
the GPU tests, and writes summary.md and results.json into the directory given as argument.

Usage: PYTHONPATH=. python3 scripts/gpu_check.py OUT_DIR   (or: make gpu-check OUT=OUT_DIR)

Every step runs in a subprocess under its own time limit, all of them inside one overall budget
(< 8 minutes); a failing or hanging step is recorded and the next one still runs, so a run always
ends with a complete report. OUT_DIR receives at most 8 flat files: summary.md, results.json,
junit_gpu.xml and one <step>.log per step. The kernel compile cache stays outside OUT_DIR: unless
KV_CANARY_CACHE_DIR is set, it goes to a fresh temporary directory.

The last step runs SGLang's own canary runtime on CUDA tensors through the kv-canary SGLang plugin
(tests/integrations/sglang/gpu_plugin_check.py) where sglang imports; elsewhere it is recorded as
skipped, with the reason.

Exit status: 0 when every step passed (the 60% bandwidth target is reported, not enforced here),
1 when a step failed, 3 when no GPU is visible (the GPU steps are then recorded as not run, which
proves the script itself on a CPU-only machine).
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
BUDGET_S = 450          # all steps together; leaves room under the 8-minute limit
EXIT_NO_GPU = 3

ENV_PROBE = r"""
import json, platform, sys
info = {"python": sys.version.split()[0], "platform": platform.platform()}
try:
    import torch
    info.update(torch=torch.__version__, torch_cuda=torch.version.cuda, cuda_available=torch.cuda.is_available())
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(device=p.name, sm_count=p.multi_processor_count, capability=f"{p.major}.{p.minor}",
                    memory_gib=round(p.total_memory / 2**30, 1))
except Exception as exc:
    info["torch_error"] = repr(exc)
try:
    import cupy
    info.update(cupy=cupy.__version__, cupy_available=bool(cupy.is_available()))
    from cupy_backends.cuda.libs import nvrtc
    info["nvrtc"] = ".".join(map(str, nvrtc.getVersion()))
except Exception as exc:
    info["cupy_error"] = repr(exc)
try:  # the SGLang plugin step runs where sglang (0.5.23, installed --no-deps) and msgspec import
    import importlib.metadata, importlib.util
    info["sglang"] = importlib.metadata.version("sglang")
    info["sglang_importable"] = all(importlib.util.find_spec(m) is not None for m in ("sglang", "msgspec"))
except Exception as exc:
    info.update(sglang_importable=False, sglang_error=repr(exc))
print(json.dumps(info))
"""

WARM_UP = r"""
import time, kv_canary
from kv_canary.launch.runtime import runtime_for
t = time.perf_counter()
mods = runtime_for(kv_canary.generated).backend("cuda").warm_up("cuda")
print(f"compiled+loaded {len(mods.binaries)} modules for sm_{mods.arch} ({'cubin' if mods.cubin else 'ptx'}) "
      f"in {time.perf_counter() - t:.1f}s on {mods.sm_count} SMs; ABI identity checked")
for symbol, fn in mods.functions.items():
    try:
        regs, smem, local = fn.num_regs, fn.shared_size_bytes, fn.local_size_bytes
    except Exception as exc:
        regs = smem = local = f"? ({exc})"
    print(f"  {symbol}: {regs} registers/thread, {smem} B static shared memory, {local} B local memory, "
          f"resident blocks/SM {mods.resident_blocks.get(symbol, '-')}")
"""

# The GPU test files: the backend's parity suite, and the fleet on a one-rank NCCL group.
GPU_TESTS = ("tests/gpu/test_gpu_backend.py", "tests/gpu/test_gpu_fleet.py")

# SGLang's canary runtime on CUDA tensors through the kv-canary plugin, against SGLang's references.
SGLANG_PLUGIN_CHECK = "tests/integrations/sglang/gpu_plugin_check.py"

# (name, limit in seconds); each gets at most what is left of BUDGET_S.
STEPS = (("environment", 30), ("warm_up", 75), ("gpu_bench", 135), ("gpu_tests", 210), ("sglang_plugin", 90))


def log(msg: str) -> None:
    print(f"[gpu-check {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def _text(data) -> str:
    if data is None:
        return ""
    return data.decode("utf-8", "replace") if isinstance(data, bytes) else data


def run_step(name: str, cmd: list[str], *, timeout: float, out_dir: Path, env: dict) -> dict:
    log(f"{name}: {' '.join(c if chr(10) not in c else '<script>' for c in cmd)} (limit {timeout:.0f}s)")
    start = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
        rc, output = proc.returncode, proc.stdout + proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        output = _text(exc.stdout) + "\n" + _text(exc.stderr) + f"\n[gpu-check] step timed out after {timeout:.0f}s"
    except OSError as exc:
        rc, output = "error", f"[gpu-check] could not start: {exc}"
    seconds = time.perf_counter() - start
    (out_dir / f"{name}.log").write_text(output)
    lines = output.strip().splitlines()
    log(f"{name}: {'ok' if rc == 0 else 'FAILED'} (rc={rc}, {seconds:.1f}s); last lines:\n" + "\n".join(lines[-8:]))
    return {"name": name, "status": "ok" if rc == 0 else "failed", "rc": rc, "seconds": round(seconds, 1),
            "log": f"{name}.log", "tail": lines[-25:]}


def not_run(name: str, why: str, status: str = "not run") -> dict:
    log(f"{name}: {status} ({why})")
    return {"name": name, "status": status, "rc": None, "seconds": 0.0, "log": None, "tail": [why]}


def step_command(name: str, py: str, out_dir: Path, bench_json: Path) -> list[str]:
    if name == "environment":
        return [py, "-c", ENV_PROBE]
    if name == "warm_up":
        return [py, "-c", WARM_UP]
    if name == "gpu_bench":
        return [py, "bench/bench_gpu.py", "--require-gpu", "--json", str(bench_json)]
    if name == "gpu_tests":
        return [py, "-m", "pytest", "-q", "-rs", "-p", "no:cacheprovider", "--durations=10",
                f"--junitxml={out_dir / 'junit_gpu.xml'}", *GPU_TESTS]
    if name == "sglang_plugin":
        return [py, SGLANG_PLUGIN_CHECK]
    raise ValueError(f"unknown step {name}")


def gpu_visible(environment: dict | None) -> tuple[bool, str]:
    if not environment:
        return False, "the environment probe failed (see environment.log)"
    if not environment.get("cuda_available"):
        return False, f"torch sees no CUDA device ({environment.get('torch_error', 'torch.cuda.is_available() is False')})"
    if not environment.get("cupy_available"):
        return False, f"CuPy sees no CUDA device ({environment.get('cupy_error', 'cupy.is_available() is False')})"
    return True, ""


def main(argv: list[str]) -> int:
    if len(argv) != 1 or argv[0].startswith("-"):
        print(__doc__)
        return 2
    out_dir = Path(argv[0]).resolve()
    out_dir.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, PYTHONUNBUFFERED="1", KV_CANARY_REQUIRE_GPU="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    env.pop("KV_CANARY_BACKEND", None)  # the GPU tests choose their backends themselves
    if not env.get("KV_CANARY_CACHE_DIR"):
        env["KV_CANARY_CACHE_DIR"] = tempfile.mkdtemp(prefix="kv_canary_gpu_check_cache_")
    bench_json = Path(tempfile.mkdtemp(prefix="kv_canary_gpu_check_")) / "bench.json"
    py = sys.executable
    started = time.perf_counter()
    results: dict = {"steps": [], "cache_dir": env["KV_CANARY_CACHE_DIR"]}
    environment, no_gpu = None, ""
    for name, limit in STEPS:
        left = BUDGET_S - (time.perf_counter() - started)
        if name != "environment" and no_gpu:
            results["steps"].append(not_run(name, f"no GPU: {no_gpu}"))
            continue
        if left < 5:
            results["steps"].append(not_run(name, f"overall budget of {BUDGET_S}s used up"))
            continue
        if name == "sglang_plugin" and not (environment or {}).get("sglang_importable"):
            why = (environment or {}).get("sglang_error", "sglang or msgspec is not importable")
            results["steps"].append(not_run(name, f"sglang is not importable here ({why}): the plugin's CUDA "
                                                  f"scenarios need sglang==0.5.23 (--no-deps) and msgspec", "skipped"))
            continue
        step = run_step(name, step_command(name, py, out_dir, bench_json), timeout=min(limit, left),
                        out_dir=out_dir, env=env)
        results["steps"].append(step)
        if name == "environment":
            try:
                environment = json.loads(step["tail"][-1])
            except (IndexError, ValueError):
                environment = None
            visible, why = gpu_visible(environment)
            no_gpu = "" if visible else why
    results["environment"] = environment
    results["seconds"] = round(time.perf_counter() - started, 1)
    try:
        results["bench"] = json.loads(bench_json.read_text()) if bench_json.exists() else None
    except ValueError as exc:
        results["bench"] = {"errors": {"bench.json": f"unreadable: {exc}"}}
    results["verdict"] = verdict(results, no_gpu)
    (out_dir / "results.json").write_text(json.dumps(results, indent=2, default=str))
    try:
        text = summary(results)
    except Exception as exc:  # never lose the report to a formatting bug: results.json has everything
        text = f"# kv-canary GPU check\n\nsummary formatting failed ({exc!r}); see results.json\n"
    (out_dir / "summary.md").write_text(text)
    log(f"done in {results['seconds']}s: " + ", ".join(f"{s['name']}={s['status']}" for s in results["steps"]))
    log(f"verdict: {results['verdict']['text']}")
    log(f"wrote {out_dir / 'summary.md'} and {out_dir / 'results.json'}")
    if no_gpu:
        log(f"NO GPU: {no_gpu}. The GPU steps did not run; this run only proves the script itself.")
        return EXIT_NO_GPU
    return 0 if all(s["status"] in ("ok", "skipped") for s in results["steps"]) else 1


def verdict(results: dict, no_gpu: str) -> dict:
    failed = [s["name"] for s in results["steps"] if s["status"] not in ("ok", "skipped")]
    target = (results.get("bench") or {}).get("verify_target")
    if no_gpu:
        text = f"NOT RUN: no GPU visible ({no_gpu})"
    elif failed:
        text = f"FAIL: step(s) {', '.join(failed)} did not pass"
    else:
        text = "PASS: every step passed"
    if target:
        text += (f"; verify bandwidth target {'MET' if target['met'] else 'NOT MET'}: "
                 f"{target['ratio']:.0%} of the copy bandwidth (target {target['target']:.0%})")
    elif not no_gpu:
        text += "; verify bandwidth target UNKNOWN (no verify/copy measurement)"
    return {"text": text, "failed_steps": failed, "verify_target": target}


def _num(value, fmt: str, scale: float = 1.0) -> str:
    return format(value / scale, fmt) if isinstance(value, (int, float)) else "n/a"


def bench_lines(bench: dict) -> list[str]:
    lines = []
    grid = bench.get("verify_grid") or {}
    if grid:
        lines.append(f"- verify grid: {grid.get('blocks')} blocks x {grid.get('threads')} threads = {grid.get('sm_count')} SMs "
                     f"x min(blocks_per_sm {grid.get('schema_blocks_per_sm')} from kernels.yaml, "
                     f"{grid.get('resident_blocks_per_sm')} resident); {grid.get('num_regs')} registers/thread, "
                     f"{grid.get('shared_size_bytes')} B static shared memory, sm_{grid.get('arch')} {grid.get('binary')}")
    copy = bench.get("copy") or {}
    if copy:
        lines.append(f"- device-to-device copy of the same {copy['bytes'] / 1e6:.0f} MB: {copy['ms']:.3f} ms, "
                     f"{copy['bandwidth_read_plus_write_Bps'] / 1e12:.2f} TB/s (read + write)")
    for key, label in (("verify_persistent", "verify, persistent grid"), ("verify_fixed_grid_64x512", "verify, SGLang 64 x 512 grid")):
        v = bench.get(key)
        if v:
            lines.append(f"- {label} (2^20 entries, ALL, 2 x 256 B; {bench.get('verify_bytes_per_entry')} B/entry): "
                         f"{v['ms']:.3f} ms, {v['entries_per_s'] / 1e9:.2f} G entries/s, {v['bytes_per_s'] / 1e12:.2f} TB/s, "
                         f"**{_num(v.get('ratio_vs_copy_bandwidth'), '.0%')} of copy bandwidth**, "
                         f"{v['violations_found']} violations (expected 0), host launch {_num(v.get('host_launch_us'), '.0f')} us")
    if "persistent_vs_fixed_grid_speedup" in bench:
        lines.append(f"- persistent grid vs SGLang's 64 x 512: {bench['persistent_vs_fixed_grid_speedup']:.2f}x "
                     f"(fixed-grid time / persistent time)")
    lines.append(f"- write: one 32,768-token prefill chain {_num(bench.get('write_prefill_32768_ms'), '.3f')} ms; "
                 f"256 one-token decodes {_num(bench.get('write_decode_256_ms'), '.3f')} ms")
    target = bench.get("write_target")
    verdict = (f"target <= {target['target']}x: {'met' if target['met'] else 'NOT met'}" if target
               else "target unknown")
    lines.append(f"- prefill chain only (bench/chain_only.cu: one thread folds the same 32,768 tokens, nothing else): "
                 f"{_num(bench.get('chain_only_32768_ms'), '.3f')} ms; write / chain only "
                 f"**{_num(bench.get('write_prefill_vs_chain_only'), '.2f')}x** ({verdict})")
    lines.append(f"- plan: 256 requests x 4,096 prefix tokens {_num(bench.get('plan_256x4096_ms'), '.3f')} ms")
    lines += [f"- {line}" for line in bench.get("host_lines") or ()]  # rendered by bench/bench_gpu.py
    for name, err in (bench.get("errors") or {}).items():
        lines.append(f"- ERROR in {name}: {err}")
    return lines


def summary(results: dict) -> str:
    lines = ["# kv-canary GPU check", "", f"**{results['verdict']['text']}**", ""]
    env = results.get("environment") or {}
    if env:
        lines += ["Environment: " + ", ".join(f"{k}={v}" for k, v in env.items()), ""]
    lines += ["| step | result | seconds |", "| --- | --- | --- |"]
    for s in results["steps"]:
        result = s["status"] if s["status"] != "failed" else f"FAILED (rc={s['rc']})"
        lines.append(f"| {s['name']} | {result} | {s['seconds']} |")
    bench = results.get("bench")
    if bench:
        lines += ["", "## Benchmarks (GPU time, CUDA events, median)", "",
                  "Verify bytes/s count what one verify must read; copy bandwidth counts bytes read + written; "
                  "the target is verify >= 60% of the copy bandwidth measured in the same run.", ""]
        lines += bench_lines(bench)
    for s in results["steps"]:
        if s["status"] != "ok":
            lines += ["", f"## {s['name']} ({s['status']})" + (f": last lines of {s['log']}" if s["log"] else ""),
                      "", "```", *s["tail"], "```"]
    lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
