"""`kv-canary demo`'s vLLM section where vLLM is not installed (the dev venv): it says so and how to get
it, and does not fail the demo (the section itself runs in `make test-vllm`'s venv)."""
from __future__ import annotations

import importlib.util
import io

import pytest

from kv_canary.demo import vllm as dv


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed: the section runs")
def test_without_vllm_the_section_says_how_to_get_it():
    out = io.StringIO()
    section = dv.demo_section(out)
    text = out.getvalue()
    assert section["ok"] and "vLLM is not installed" in section["skipped"]
    assert "real engine: vLLM through its KV connector API" in text
    assert "pip install 'kv-canary[vllm]'" in text and "make test-vllm" in text
