"""README.md's launch-API example runs and prints what the README says it prints."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def _block(text: str, lang: str, after: str) -> str:
    start = text.index(f"```{lang}\n", text.index(after)) + len(lang) + 4
    return text[start:text.index("```", start)]


def test_readme_example_prints_the_documented_violation(tmp_path):
    text = README.read_text(encoding="utf-8")
    code = _block(text, "python", "## Using the launch API")
    expected = _block(text, "text", "## Using the launch API")
    script = tmp_path / "example.py"
    script.write_text(code, encoding="utf-8")
    out = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, check=True, cwd=tmp_path)
    assert out.stdout == expected


def test_readme_coming_from_sglang_block_builds_a_manager(monkeypatch):
    for name in ("RING_CAPACITY", "STATS_PRINT_EVERY_N_STEPS", "ENABLE_WRITE_INPUT_ASSERT",
                 "ENABLE_VERIFY_TOKEN_ASSERT", "ENABLE_MHA_V"):
        monkeypatch.delenv(f"SGLANG_KV_CANARY_{name}", raising=False)
    scope = {}
    exec(compile(_block(README.read_text(encoding="utf-8"), "python", "## Coming from SGLang"), "README.md", "exec"),
         scope)
    m = scope["manager"]
    assert (m.mode, m.real_kv_hash_mode.name, m.sweep_interval, m.stats_print_every_n_steps) == ("log", "NONE", 0, 100)
