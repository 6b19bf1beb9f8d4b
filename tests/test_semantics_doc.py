"""docs/semantics.md is the contract the code cites: every `semantics.md §N` citation in the tree
names a section it has, and nothing cites the contract's old home outside the repository."""
from __future__ import annotations

import re
import subprocess

from support.trees import ROOT, SPEC_DIR, load_vectors

DOC = ROOT / "docs" / "semantics.md"
CITATION = re.compile(r"semantics\.md\s+§\s*(\d+(?:\.\d+)?)")
HEADING = re.compile(r"^#{2,3} (\d+(?:\.\d+)?)\.? ", re.M)


def _tracked_texts():
    names = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout.split()
    for name in names:
        path = ROOT / name
        if path.suffix in {".py", ".md", ".j2", ".yaml", ".cuh", ".h", ".cu", ".cpp", ".json"} and path.is_file():
            yield name, path.read_text(encoding="utf-8", errors="replace")


def test_every_citation_names_a_section_of_the_contract():
    sections = set(HEADING.findall(DOC.read_text(encoding="utf-8")))
    assert {"1", "2", "3", "4", "5", "5.1", "5.2", "5.3", "5.4", "6", "7", "8", "9", "10"} <= sections
    cited, old = {}, []
    for name, text in _tracked_texts():
        for number in CITATION.findall(text):
            cited.setdefault(number, name)
        if re.search(r"SEMANTICS(\.md)?\s*§|shared/spec", text) and name != "tests/test_semantics_doc.py":
            old.append(name)
    assert cited and not {n: f for n, f in cited.items() if n not in sections}
    assert old == [], f"cite docs/semantics.md instead: {old}"


def test_the_golden_vectors_live_in_the_repository():
    assert SPEC_DIR == ROOT / "tests" / "spec" or SPEC_DIR.is_dir()
    vectors = load_vectors()
    assert set(vectors) == {"splitmix64", "chain_example", "link_negative", "real_kv_fold"}
    assert vectors["chain_example"]["head_hash"] == "0xde7fae23a9a1b716"


def test_the_docs_index_lists_every_page():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    assert [p for p in pages if f"]({p})" not in index] == []
