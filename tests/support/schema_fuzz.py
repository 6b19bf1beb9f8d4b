"""Schema mutations and their checks, for the generator fuzz test (tests/codegen/test_schema_fuzz.py).

A case is kernels.yaml changed by a few mutations, drawn by hypothesis:
- structural, on the composed YAML node graph (so that duplicate keys, aliases and self-references
  can be written, which a dict cannot hold): delete, duplicate or rename a key (to another key of
  the schema or a key's former name, such as a kernel's `template:`) or list item, replace
  a value by one of another type, an extreme integer or an odd string (unicode, controls,
  bidirectional controls, trigraphs, reserved names), nudge an integer, wrap a node in deep
  nesting, reuse a node elsewhere (an alias), make a node contain itself, build an alias bomb;
- textual, on the serialised text: insert an odd character or byte, delete a span, truncate, CRLF.

`check_case` runs one case through the front end as `generate` does (bytes -> text -> schema ->
rendered files) and asserts the contract: either every diagnostic is one well-formed, located,
printable line and none is an internal error, or the schema loads and every generated Python file
compiles. `TreeChecker` goes further for clean schemas (the large budget): the tree is written,
imported, built by g++ (emulated backend) and NVRTC, and runs a short torch-vs-emulated differential.
"""
from __future__ import annotations

import hashlib
import random
import re
import signal
from dataclasses import dataclass, field
from pathlib import Path

import yaml
from hypothesis import assume
from hypothesis import strategies as st
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.load import layout_fingerprint, load_schema_text, schema_text
from kv_canary.codegen.parse import FORMER_KERNEL_KEYS
from kv_canary.codegen.render import render_all, split_header

ROOT = Path(__file__).resolve().parents[2]
NAME = "kernels.yaml"
BASE_TEXT = (ROOT / NAME).read_text(encoding="utf-8")
_LOADER = getattr(yaml, "CSafeLoader", yaml.SafeLoader)
_DUMPER = getattr(yaml, "CSafeDumper", yaml.SafeDumper)
_BASE = yaml.compose(BASE_TEXT, Loader=_LOADER)

ODD_STRINGS = (
    "", " ", "x" * 65, "k" * 300, "a\nb", "tab\there", "\x1b[31mred", "nul\x00", "del\x7f", "c1\x85\x9b",
    "\u202eevil", "iso\u2066late\u2069", "zw\u200bsp", "ls\u2028ps\u2029", "bom\ufeff", "\ud800", "\U0001f600",
    "??=", "a??/", "??(x??)", "*/", "/*", "-->", "{{ x }}", "{% if %}", "#}", "back\\slash", "'q'", '"dq"',
    "é", "ÄÖ", "日本", "NULL", "ENOMEM", "EOF", "printf", "threadIdx", "CON", "kv_canary", "int", "class",
    "__x", "_x", "x__y", "0x", "1bad", "null", "yes", "NO", "~", "1e3", "0o17", "2001-02-30", ".inf", "<<",
    "GENERATION_ID", "layout", "api", "Token", "TOKEN", "canary_write", "CANARY_WRITE",
)
EXTREME_INTS = (0, -1, 1, 2, 7, 8, 16, 24, 31, 32, 33, 40, 63, 64, 65, 1023, 1024, 1025, 4096, 4104, 65535,
                65536, 2**31 - 8, 2**31 - 1, 2**31, 2**32, 2**53 + 1, 2**62, 2**63 - 1, 2**63, 2**64 - 1, 2**64,
                -2**31, -2**63, -2**63 - 1, 10**30, 10**79)
ODD_CHARS = tuple(":-[]{}&*!%@`|>#'\",?\t\r\n\\ ") + ("\x00", "\x1b", "\x85", "\u2028", "\u202e", "\ufeff", "é")
ODD_BYTES = (b"\xff", b"\xc3", b"\xe2\x80", b"\xed\xa0\x80", b"\xf8\x88\x80\x80\x80", b"\x00")

# Valid identifiers that C, POSIX, CUDA or the generated code itself may already use: renaming a
# constant, a flag or enum member or a kernel to one keeps the schema loadable and tests the build.
C_NAMES = ("ENOMEM", "EAGAIN", "EINTR", "SIGSEGV", "CLOCK_MONOTONIC", "PATH_MAX", "CUDA_VERSION", "memchr",
           "kvc_emu", "kvc_emu_last_error", "kvc_emu_set_strict", "kv_canary_abi_version",
           "kv_canary_layout_fingerprint", "canary_verify", "ring", "lane", "tid", "slot", "buf", "Ring")

STRUCTURAL = ("delete", "duplicate", "rename_key", "rename_name", "replace", "extreme_int", "nudge_int",
              "odd_string", "nest", "alias", "self_reference", "alias_bomb", "swap")
TEXTUAL = ("insert_char", "insert_byte", "delete_span", "truncate", "crlf")


@dataclass
class Case:
    mutations: list[str]
    raw: bytes

    def __repr__(self) -> str:  # what hypothesis prints for a failing example
        return f"Case(mutations={self.mutations!r}, raw=<{len(self.raw)} bytes, sha256 " \
               f"{hashlib.sha256(self.raw).hexdigest()[:16]}>)"


# -- the node graph -----------------------------------------------------------------------------
def _slots(root: yaml.Node) -> list[tuple[yaml.Node, int, str]]:
    """(container, index, part) of every node below root in document order; part is 'item' for a
    list entry, 'key' or 'value' for a mapping entry. Iterative, and safe on shared or cyclic nodes."""
    out, stack, seen = [], [root], set()
    while stack:
        node = stack.pop()
        if id(node) in seen or not isinstance(node, yaml.CollectionNode):
            continue
        seen.add(id(node))
        children = []
        for i, entry in enumerate(node.value):
            if isinstance(node, yaml.SequenceNode):
                out.append((node, i, "item"))
                children.append(entry)
            else:
                out += [(node, i, "key"), (node, i, "value")]
                children += list(entry)
        stack.extend(reversed(children))
    return out


def _entry(node: yaml.Node, key: str) -> yaml.Node | None:
    if isinstance(node, yaml.MappingNode):
        return next((v for k, v in node.value if isinstance(k, yaml.ScalarNode) and k.value == key), None)
    return None


def _name_slots(root: yaml.Node) -> list[tuple[yaml.Node, int, str]]:
    """Slots of the names a schema author chooses: constants, flag and enum members, kernel names."""
    out = []
    constants = _entry(root, "constants")
    if isinstance(constants, yaml.MappingNode):
        out += [(constants, i, "key") for i in range(len(constants.value))]
    for section in ("flags", "enums"):
        sets = _entry(root, section)
        for _, members in (sets.value if isinstance(sets, yaml.MappingNode) else ()):
            if isinstance(members, yaml.MappingNode):
                out += [(members, i, "key") for i in range(len(members.value))]
    kernels = _entry(root, "kernels")
    for kernel in (kernels.value if isinstance(kernels, yaml.SequenceNode) else ()):
        if isinstance(kernel, yaml.MappingNode):
            out += [(kernel, i, "value") for i, (k, _) in enumerate(kernel.value)
                    if isinstance(k, yaml.ScalarNode) and k.value == "name"]
    return out


def _get(slot) -> yaml.Node:
    container, i, part = slot
    entry = container.value[i]
    return entry if part == "item" else entry[0 if part == "key" else 1]


def _set(slot, node: yaml.Node) -> None:
    container, i, part = slot
    if part == "item":
        container.value[i] = node
    else:
        key, value = container.value[i]
        container.value[i] = (node, value) if part == "key" else (key, node)


def _copy(node: yaml.Node, memo: dict | None = None) -> yaml.Node:
    """A copy of a node graph that shares the (immutable) marks: copy.deepcopy spends most of its time
    copying them. Shared and cyclic nodes stay shared and cyclic."""
    memo = {} if memo is None else memo
    if id(node) in memo:
        return memo[id(node)]
    if isinstance(node, yaml.ScalarNode):
        out = memo[id(node)] = yaml.ScalarNode(node.tag, node.value, node.start_mark, node.end_mark, node.style)
        return out
    out = memo[id(node)] = type(node)(node.tag, [], node.start_mark, node.end_mark, node.flow_style)
    for entry in node.value:
        out.value.append(_copy(entry, memo) if isinstance(node, yaml.SequenceNode) else
                         (_copy(entry[0], memo), _copy(entry[1], memo)))
    return out


def _node(value) -> yaml.Node:
    """The YAML node a Python value dumps to (tags resolved as a loader would)."""
    return yaml.compose(yaml.dump(value, Dumper=yaml.SafeDumper, allow_unicode=True), Loader=yaml.SafeLoader)


def _scalar_int(node: yaml.Node) -> int | None:
    if isinstance(node, yaml.ScalarNode) and node.tag == "tag:yaml.org,2002:int":
        try:
            return int(yaml.safe_load(node.value))
        except (ValueError, TypeError, yaml.YAMLError):
            return None
    return None


_values = st.one_of(
    st.none(), st.booleans(), st.sampled_from(EXTREME_INTS), st.integers(-100, 100),
    st.sampled_from((1.5, -0.0, float("inf"), float("nan"))), st.sampled_from(ODD_STRINGS),
    st.from_regex(r"[a-z][a-z0-9_]{0,12}", fullmatch=True),
    st.lists(st.integers(0, 3), max_size=3), st.dictionaries(st.sampled_from(("a", "name", "doc")),
                                                             st.integers(0, 3), max_size=2))


def _mutate(draw, root: yaml.Node, kind: str) -> str:
    slots = _slots(root)
    if not slots:
        return f"{kind}: nothing to mutate"
    slot = slots[draw(st.integers(0, len(slots) - 1))]
    container, i, part = slot
    where = f"{kind} at {_get(slot).start_mark.line + 1 if _get(slot).start_mark else '?'}:{part}"
    if kind == "delete":
        del container.value[i]
    elif kind == "duplicate":
        entry = container.value[i]
        container.value.insert(i + 1, _copy(entry) if part == "item" else (_copy(entry[0]), _copy(entry[1])))
    elif kind == "rename_key":
        keys = [s for s in slots if s[2] == "key"]
        slot = keys[draw(st.integers(0, len(keys) - 1))]
        # the schema's keys and the former names it still accepts (a kernel's `template:` gives a note)
        other = sorted({_get(s).value for s in keys if isinstance(_get(s), yaml.ScalarNode)} | set(FORMER_KERNEL_KEYS))
        name = draw(st.one_of(st.sampled_from(ODD_STRINGS), st.sampled_from(other),
                              st.from_regex(r"[a-z_][a-z_0-9]{0,10}", fullmatch=True)))
        _set(slot, _node(name))
        where += f" -> {name!r}"
    elif kind == "rename_name":
        names = _name_slots(root)
        assume(names)
        slot = names[draw(st.integers(0, len(names) - 1))]
        name = draw(st.sampled_from(C_NAMES))
        where = f"{kind} {_get(slot).value!r} -> {name!r}"
        _set(slot, _node(name))
    elif kind == "replace":
        value = draw(_values)
        _set(slot, _node(value))
        where += f" -> {value!r}"
    elif kind == "extreme_int":
        value = draw(st.sampled_from(EXTREME_INTS))
        _set(slot, _node(value))
        where += f" -> {value}"
    elif kind == "nudge_int":  # small changes keep many schemas valid: new layouts and launch shapes
        ints = [s for s in slots if _scalar_int(_get(s)) is not None]
        assume(ints)
        slot = ints[draw(st.integers(0, len(ints) - 1))]
        value = _scalar_int(_get(slot)) + draw(st.sampled_from((-8, -1, 1, 8, 16, 32, 64)))
        _set(slot, _node(value))
        where = f"{kind} at {_get(slot).start_mark.line + 1 if _get(slot).start_mark else '?'} -> {value}"
    elif kind == "odd_string":
        text = draw(st.sampled_from(ODD_STRINGS))
        old = _get(slot)
        if isinstance(old, yaml.ScalarNode) and draw(st.booleans()):
            text = old.value + text  # e.g. a doc string with something appended
        _set(slot, _node(text))
        where += f" -> {text!r}"
    elif kind == "nest":
        node = _get(slot)
        depth = draw(st.integers(1, 120))
        for _ in range(depth):
            node = yaml.SequenceNode("tag:yaml.org,2002:seq", [node], flow_style=True) if draw(st.booleans()) else \
                yaml.MappingNode("tag:yaml.org,2002:map", [(_node("k"), node)], flow_style=True)
        _set(slot, node)
        where += f" x{depth}"
    elif kind == "alias":  # the same node object twice: the serializer writes an anchor and an alias
        other = slots[draw(st.integers(0, len(slots) - 1))]
        _set(slot, _get(other))
    elif kind == "self_reference":
        node = _get(slot)
        assume(isinstance(node, yaml.CollectionNode))
        if isinstance(node, yaml.SequenceNode):
            node.value.append(node)
        else:
            node.value.append((_node("self"), node))
    elif kind == "alias_bomb":
        node = _node("lol")
        for _ in range(draw(st.integers(2, 9))):
            node = yaml.SequenceNode("tag:yaml.org,2002:seq", [node] * 9, flow_style=True)
        _set(slot, node)
    elif kind == "swap":
        other = slots[draw(st.integers(0, len(slots) - 1))]
        a, b = _get(slot), _get(other)
        _set(slot, b)
        _set(other, a)
    return where


def _edit_text(draw, raw: bytes, kind: str) -> tuple[bytes, str]:
    at = draw(st.integers(0, len(raw)))
    if kind == "insert_char":
        ch = draw(st.sampled_from(ODD_CHARS))
        return raw[:at] + ch.encode("utf-8") + raw[at:], f"{kind} {ch!r} at byte {at}"
    if kind == "insert_byte":
        b = draw(st.sampled_from(ODD_BYTES))
        return raw[:at] + b + raw[at:], f"{kind} {b!r} at byte {at}"
    if kind == "delete_span":
        n = draw(st.integers(1, 40))
        return raw[:at] + raw[at + n:], f"{kind} {n} bytes at {at}"
    if kind == "truncate":
        return raw[:at], f"{kind} at byte {at}"
    return raw.replace(b"\n", b"\r\n"), kind


@st.composite
def mutated_schemas(draw) -> Case:
    root = _copy(_BASE)
    labels = [_mutate(draw, root, draw(st.sampled_from(STRUCTURAL))) for _ in range(draw(st.integers(0, 3)))]
    options = {"allow_unicode": draw(st.booleans()), "width": draw(st.sampled_from((80, 4096)))}
    text = None
    for dumper in dict.fromkeys((_DUMPER, yaml.SafeDumper)):  # libyaml cannot write a lone surrogate
        try:
            text = yaml.serialize(root, Dumper=dumper, **options)
            break
        except (yaml.YAMLError, UnicodeEncodeError, RecursionError):
            continue
    assume(text is not None)  # a graph no emitter can write: not a schema
    raw = text.encode("utf-8", errors="surrogatepass")  # a lone surrogate becomes bytes that are not UTF-8
    for _ in range(draw(st.integers(0, 2)) if draw(st.integers(0, 3)) == 0 else 0):
        raw, label = _edit_text(draw, raw, draw(st.sampled_from(TEXTUAL)))
        labels.append(label)
    return Case(labels, raw)


# -- checking one case ---------------------------------------------------------------------------
_DIAGNOSTIC = re.compile(rf"{re.escape(NAME)}:(\d+):(\d+): error: \S.*")


class Hang(Exception):
    pass


@dataclass
class Stats:
    tried: int = 0
    rejected: int = 0      # diagnostics, as the contract wants
    clean: int = 0         # loaded; every file rendered and every Python file compiled
    diagnostics: int = 0
    internal: int = 0      # tracebacks turned into "internal error" reports: must stay 0
    hangs: int = 0
    trees_checked: int = 0  # clean trees written, imported, built with g++ and NVRTC, run differentially
    trees_skipped: int = 0  # clean trees with a layout and kernel ABI already checked (or over the cap)
    hang_cases: list = field(default_factory=list)
    tree_failures: list = field(default_factory=list)  # (case, error): a clean schema whose tree fails

    def summary(self) -> str:
        return (f"schema fuzz: {self.tried} mutations tried, {self.rejected} rejected with {self.diagnostics} "
                f"diagnostics, {self.clean} loaded and rendered, {self.trees_checked} trees generated and checked "
                f"({self.trees_skipped} more skipped as already checked), tracebacks = {self.internal}, "
                f"hangs = {self.hangs}, tree failures = {len(self.tree_failures)}")

    def failure_report(self) -> str:
        """The tree failures, one per distinct first line of error (with the case that showed it)."""
        seen, lines = set(), []
        for case, error in self.tree_failures:
            first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
            if first not in seen:
                seen.add(first)
                lines.append(f"{case!r}: {type(error).__name__}: {str(error)[:2000]}")
        return "\n".join(lines)


def check_report(exc: SchemaError, raw: bytes, text: str | None) -> int:
    """Assert that a rejection is a proper report; returns its number of diagnostics."""
    if exc.internal:
        raise AssertionError(f"the front end raised instead of reporting: {exc}") from exc.__cause__
    lines = str(exc).split("\n")
    assert lines and len(lines) == len(exc.diagnostics), lines
    n_lines = (text.count("\n") if text is not None else raw.count(b"\n")) + 1
    for line in lines:
        m = _DIAGNOSTIC.fullmatch(line)
        assert m, f"malformed diagnostic: {line!r}"
        assert line.isprintable(), f"diagnostic with a non-printable character: {line!r}"
        assert 1 <= int(m.group(1)) <= n_lines and int(m.group(2)) >= 1, f"location outside the file: {line!r}"
    return len(lines)


def check_case(case: Case, env, stats: Stats, trees: "TreeChecker | None" = None, hang_s: float = 0) -> None:
    stats.tried += 1
    if hang_s:
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.setitimer(signal.ITIMER_REAL, hang_s)
    try:
        text = None
        try:
            text = schema_text(case.raw, NAME)
            schema = load_schema_text(text, NAME)
        except SchemaError as exc:
            stats.diagnostics += check_report(exc, case.raw, text)
            stats.rejected += 1
            return
        files = render_all(schema, text, env)
    except Hang:
        stats.hangs += 1
        stats.hang_cases.append(case)
        return
    except AssertionError:
        stats.internal += 1
        raise
    finally:
        if hang_s:
            signal.setitimer(signal.ITIMER_REAL, 0)
    for f in files:
        if f.path.endswith(".py"):
            compile(f.text, f.path, "exec")
    stats.clean += 1
    if trees is not None:
        trees.check(case, schema, files, stats)


def _on_alarm(signum, frame):
    raise Hang()


# -- the large budget: build and run every new clean tree ----------------------------------------
KINDS = (("write", "make_write_case", True), ("verify", "make_verify_case", False),
         ("plan", "make_plan_case", True), ("scatter", "make_scatter_case", True))


class TreeChecker:
    """Writes, imports, builds (g++, NVRTC) and differentially runs clean trees, each new pair of
    (layout fingerprint, kernel ABI) once, at most `cap` of them."""

    def __init__(self, root: Path, cap: int, seeds: int = 2) -> None:
        self.root, self.cap, self.seeds = root, cap, seeds
        self.seen: set[tuple[str, str]] = set()

    def check(self, case: Case, schema, files, stats: Stats) -> None:
        abi = next(split_header(f.text)[1] for f in files if f.path == "kernel_abi.py")
        key = (layout_fingerprint(schema), hashlib.sha256(abi.encode()).hexdigest())
        if key in self.seen or len(self.seen) >= self.cap:
            stats.trees_skipped += 1
            return
        self.seen.add(key)
        stats.trees_checked += 1
        try:
            build_and_run(self.root / f"tree{len(self.seen)}", files, self.seeds)
        except Exception as exc:  # collected, so that one run reports every distinct failure
            stats.tree_failures.append((case, exc))


def build_and_run(out: Path, files, seeds: int, *, nvrtc_compile: bool = True) -> None:
    """Write `files` to `out`, import every generated module, build the emulation library, compile
    every kernel with NVRTC (unless `nvrtc_compile` is False) and run `seeds` differential cases of
    each kernel against the torch reference."""
    import importlib

    from kv_canary.codegen.writer import write_tree

    import kv_canary
    from kv_canary.trees import nvrtc
    from kv_canary.trees.sources import kernel_abi, read_source
    from support import kernel_diff, scenarios

    write_tree(out, files)
    tree = kv_canary.load_generated(out, f"kv_canary_fuzz_{out.name}_{id(files):x}")
    for module in sorted(p.stem for p in out.glob("*.py") if p.stem != "__init__"):  # every generated module
        importlib.import_module(f"{tree.__name__}.{module}")
    scenarios.runtime_for(tree).backend("emulated")   # g++ builds the emulation library
    abi = kernel_abi(tree)
    try:
        importlib.import_module("cupy_backends.cuda.libs.nvrtc")
    except ImportError:
        nvrtc_compile = False
    if nvrtc_compile:
        headers = {"kv_canary_layout.cuh": read_source(tree, abi.HEADER)}
        for kernel in abi.KERNELS.values():
            nvrtc.compile_source(read_source(tree, kernel.source), kernel.source, headers, arch=90)
    for kind, make, ordered in KINDS:
        for seed in range(seeds):
            case = getattr(scenarios, make)(random.Random(seed), tree)
            kernel_diff.compare(tree, kind, case, "emulated", ordered=ordered)
    check_partial_limit(tree, seeds)
    check_refusals(tree)


def check_partial_limit(tree, seeds: int) -> None:
    """PARTIAL at the tree's REAL_KV_PARTIAL_READ_BYTES: sources of exactly that many bytes per slot
    (the last slot's read ends at its tensor's last byte) run alike on the reference and the emulated
    kernels; a source with 16 fewer is refused before any launch, on both (issue 32)."""
    import dataclasses

    import pytest
    import torch

    from support import kernel_diff, scenarios

    lay = tree.layout
    partial, align, mode = lay.REAL_KV_PARTIAL_READ_BYTES, lay.REAL_KV_LOAD_ALIGN_BYTES, lay.RealKvHashMode.PARTIAL
    alloc = scenarios.runtime_for(tree).allocators
    for seed in range(seeds):
        case = scenarios.make_write_case(random.Random(seed), tree)
        slots = int(case["context"].canary_buf.shape[0])

        def source(nbpt: int, page: int = 1):
            rows = -(-slots // page)
            data = torch.randint(0, 256, (rows, page * nbpt), dtype=torch.uint8, generator=torch.Generator().manual_seed(seed))
            return alloc.RealKvSource(tensor=data, page_size=page, num_bytes_per_token=nbpt, read_bytes=align)
        if partial <= scenarios.PARTIAL_SLOT_CAP:
            at_limit = (source(partial), source(partial, page=4))
            kernel_diff.compare(tree, "write", dict(case, context=dataclasses.replace(
                case["context"], real_kv_sources=at_limit, real_kv_hash_mode=mode)), "emulated", ordered=True)
        if partial > align:
            short = dict(case, context=dataclasses.replace(case["context"], real_kv_sources=(source(partial - align),),
                                                           real_kv_hash_mode=mode))
            refusal = lay.MESSAGE_PREFIX + lay.MESSAGES["real_kv_partial"].format(i=0, n=partial - align)
            for backend in ("torch", "emulated", "cpu"):
                with pytest.raises(ValueError) as exc:
                    scenarios.runtime_for(tree).launch_canary_write_kernel(**scenarios.clone_case(short), backend=backend)
                assert str(exc.value) == refusal


def check_refusals(tree) -> None:
    """What every tree refuses, whatever its schema (issue 32): a size helper given a size its
    allocator refuses, and a launch whose outputs share memory (the ring moved into the canary
    records after its context was built), on both host backends, before anything is written."""
    import torch

    from support import scenarios

    alloc, prefix = tree.allocators, tree.layout.MESSAGE_PREFIX
    for helper in (alloc.canary_buf_bytes, alloc.violation_ring_bytes):
        for bad, exc in ((-1, ValueError), ("8", TypeError), (None, TypeError), (2**70, ValueError)):
            try:
                helper(bad)
            except exc as e:
                assert str(e).startswith(prefix), (helper.__name__, bad, e)
            else:
                raise AssertionError(f"{helper.__name__}({bad!r}) was accepted")
    runtime = scenarios.runtime_for(tree)
    for backend in ("torch", "emulated", "cpu"):
        case = scenarios.make_write_case(random.Random(0), tree, n_reqs=1)
        ctx = case["context"]
        row = ctx.violation_ring.shape[1]
        ctx.violation_ring.set_(ctx.canary_buf.untyped_storage(), 0, (1, row), (row, 1))
        before = ctx.canary_buf.clone()
        try:
            runtime.launch_canary_write_kernel(**case, backend=backend)
        except ValueError as e:
            pair = {f"{prefix}violation_ring overlaps canary_buf", f"{prefix}canary_buf overlaps violation_ring"}
            assert str(e).partition(": this launch writes both")[0] in pair, e
        else:
            raise AssertionError(f"{backend}: a ring inside the canary records was accepted")
        assert torch.equal(ctx.canary_buf, before)
