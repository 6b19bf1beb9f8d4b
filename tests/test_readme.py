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


def test_readme_sglang_timing_commands_run_as_written(tmp_path):
    """The README's SGLang timing block: each line runs (from a checkout after `make setup`) and the
    last prints each provider's seconds."""
    import importlib.util
    import os
    import subprocess

    import pytest
    if importlib.util.find_spec("sglang") is None or importlib.util.find_spec("msgspec") is None:
        pytest.skip("sglang is not installed (make setup installs it)")
    root = README.parent
    lines = [x.strip() for x in _block(README.read_text(encoding="utf-8"), "bash", "**What it costs**").strip().splitlines()]
    assert len(lines) == 3 and all(line.startswith(".venv/bin/python ") for line in lines)
    env = {k: v for k, v in os.environ.items() if not k.startswith("KV_CANARY")}

    def argv(line: str) -> list[str]:   # the checkout's paths, from a scratch directory
        import shlex
        words = shlex.split(line)
        return [sys.executable] + [str(root / w) if w.startswith("tests/") else w for w in words[1:]]
    # The two lines differ only in the provider and the output file (test_sglang_plugin runs both
    # providers through this script); the plugin's line runs here, and its JSON stands for both.
    first, second = argv(lines[0]), argv(lines[1])
    assert [i for i, (a, b) in enumerate(zip(first, second)) if a != b] == [first.index("--provider") + 1, len(first) - 1]
    proc = subprocess.run(argv(lines[1]), cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (tmp_path / "sglang.json").write_bytes((tmp_path / "plugin.json").read_bytes())
    out = subprocess.run(argv(lines[2]), cwd=tmp_path, capture_output=True, text=True, check=True).stdout.split()
    assert out[0::2] == ["sglang.json", "plugin.json"] and all(float(x) > 0 for x in out[1::2])
