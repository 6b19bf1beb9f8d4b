"""docs/architecture.md's glossary holds: the uses it retires are gone from the code, the tests, the
benchmarks and the documents (a word keeps one meaning)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
DOC = (ROOT / "docs" / "architecture.md").read_text(encoding="utf-8")
SOURCES = [p for d in ("kv_canary", "bench", "tests", "docs", "generated") for p in (ROOT / d).rglob("*")
           if p.suffix in (".py", ".md", ".yaml") and "__pycache__" not in p.parts] + [ROOT / "README.md",
                                                                                     ROOT / "kernels.yaml"]
# (what is retired, the pattern of a use, the one file that may still hold it: its alias or this test)
RETIRED = [
    ("the manager's staging called prepare", re.compile(r"\b(?:manager|self\.m|m)\.prepare\(batch\)|`prepare\(batch\)`"),
     {"docs/architecture.md"}),
    ("Runtime.prepare / Runtime.launch by operation name", re.compile(r"\bRuntime\.(?:prepare|launch)\b"), set()),
    ("the generated api's _runtime hop", re.compile(r"_runtime\(\)\.launch\("), set()),
    ("a launch-tag phase or half spelled out in the engine", re.compile(r"SWEEP_PHASE|(?<!STEP_)V_HALF\b"), set()),
    ("a kernel naming its operation with the former key template:",
     re.compile(r"\btemplate: (?:write|verify|plan_offsets|plan_entries|scatter)\b"),
     {"tests/support/schema_errors.py"}),  # its case of both keys at once
    ("dispatch by an operation's name", re.compile(r'getattr\(self\.(?:reference|checks), operation|_checks\[operation\]'),
     {"tests/test_launch_path.py"}),
    ("a generated tree or kv_canary's tier called layer",
     re.compile(r"\bdefault_layer\b|\bgenerate_layer\b|\bPerLayer\b|\bkv_canary[./]layer\b|(?<![\w.-])layer/"
                r"|\.layer\b|\blayer=|\[['\"]layer['\"]|\"layer\":|\b(?:generated|Python|default) layers?\b"
                r"|\bLayer \d:"),
     {"kv_canary/__init__.py", "kv_canary/engine/manager.py", "kv_canary/integrations/vllm/options.py",
      "docs/architecture.md"}),
]


def test_the_glossary_names_each_word():
    for word in ("operation", "binding", "staging", "step roles", "template", "layer", "tree", "tier"):
        assert re.search(rf"^\| {word} \|", DOC, re.M), word


@pytest.mark.parametrize("what,pattern,allowed", RETIRED, ids=[r[0] for r in RETIRED])
def test_retired_uses_are_gone(what, pattern, allowed):
    here = Path(__file__).relative_to(ROOT).as_posix()
    found = [f"{p.relative_to(ROOT).as_posix()}:{n}" for p in SOURCES for n, line in
             enumerate(p.read_text(encoding="utf-8", errors="replace").splitlines(), 1)
             if pattern.search(line) and p.relative_to(ROOT).as_posix() not in allowed | {here}]
    assert not found, f"{what}: {found}"


def test_the_staging_alias_is_the_staging():
    from kv_canary.engine.manager import CanaryManager
    assert "stage(batch)" in CanaryManager.prepare.__doc__


def test_the_former_names_of_tree_still_work_and_say_the_new_one():
    import kv_canary
    from kv_canary.engine.manager import CanaryManager
    from kv_canary.integrations.vllm.options import Options

    with pytest.warns(DeprecationWarning, match=r"kv_canary\.generate_tree"):
        assert kv_canary.generate_layer is kv_canary.generate_tree
    with pytest.warns(DeprecationWarning, match=r"CanaryManager\(tree=\.\.\.\)"):
        manager = CanaryManager(layer=kv_canary.generated)
    assert manager.tree is kv_canary.generated
    with pytest.warns(DeprecationWarning, match=r"CanaryManager\.tree"):
        assert manager.layer is kv_canary.generated
    with pytest.raises(ValueError, match="tree= .* or layer=, its former name, not both"):
        CanaryManager(tree=kv_canary.generated, layer=kv_canary.generated)
    with pytest.warns(DeprecationWarning, match=r"rename the key to 'tree'"):
        assert Options.parse({"layer": "myengine._canary"}).tree == "myengine._canary"
    with pytest.raises(ValueError, match="both 'tree' and 'layer'"):
        Options.parse({"layer": "a", "tree": "b"})
