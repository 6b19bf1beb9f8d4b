"""`make gpu-check`'s SGLang step: SGLang's canary runtime on CUDA tensors through the plugin (kv-canary's
CUDA kernels), against the same scenarios on SGLang's own torch references on the CPU (which SGLang
pins byte for byte to its CUDA kernels). Violation rows land in any order on a GPU, so rings, log
lines and raise texts are compared as multisets; buffers, counters and health errors exactly.

Usage: python tests/integrations/sglang/gpu_plugin_check.py   (exit 0: identical, 1: a difference)
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

HERE = Path(__file__).resolve().parent
EXACT = ("counters", "buffers", "write_index", "canary_bytes")


def run(provider: str, device: str, out: Path) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("KV_CANARY_SGLANG", "KV_CANARY_BACKEND")}
    env["KV_CANARY_SGLANG_TEST_DEVICE"] = device
    subprocess.run([sys.executable, str(HERE / "sglang_scenarios.py"), "--provider", provider, str(out)], env=env,
                   check=True, timeout=240)
    return json.loads(out.read_text())


def as_multiset(record: dict) -> dict:
    lines = lambda texts: sorted(line for t in texts for line in t.split("\n"))  # noqa: E731
    return {"ring": sorted(map(tuple, record["ring"])),
            "logs": lines(m for _, _, m in record["logs"]),
            "errors": lines(e["text"] for e in record["errors"])}


def main() -> int:
    tmp = Path(tempfile.mkdtemp(prefix="kv_canary_sglang_gpu_"))
    reference = run("sglang", "cpu", tmp / "sglang_cpu.json")
    device = os.environ.get("KV_CANARY_SGLANG_GPU_CHECK_DEVICE", "cuda")   # "cpu": a self-test without a GPU
    plugin = run("plugin", device, tmp / f"plugin_{device}.json")
    print(plugin["plugin_log"][0][2] if plugin["plugin_log"] else "no plugin start-up line")
    failed = 0
    for name, ref in reference["scenarios"].items():
        got = plugin["scenarios"][name]
        bad = [k for k in EXACT if got[k] != ref[k]]
        bad += [k for k, v in as_multiset(got).items() if v != as_multiset(ref)[k]]
        failed += bool(bad)
        print(f"{name}: {'identical' if not bad else 'DIFFERS in ' + ', '.join(bad)} "
              f"({ref['write_index']} violation rows)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
