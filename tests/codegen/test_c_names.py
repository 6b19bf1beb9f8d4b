"""Generated C/C++ names cannot collide with anything.

Every identifier the generator derives from a schema name reaches C/C++ behind a prefix of its kind
(kvc_const_, kvc_field_, kvc_set_, kvc_member_, extra_input_, ..., and kvcanary_ for entry points),
so no list of reserved C names is needed:
- a probe schema with sentinel names shows every such prefix, and no macro the emulated build sees
  (the shim, the C and C++ standard headers, the platform's) starts with one;
- a schema named after macros (ENOMEM, PROT_READ, CLOCK_MONOTONIC, NULL, ...), libc and CUDA names,
  the shim's and the generated header's own names, with a kernel name of the longest allowed length, passes the
  schema checks, builds with g++ and NVRTC, and runs exactly like the torch reference;
- schema text in generated comments is escaped (control, bidi and trigraph characters).
"""
from __future__ import annotations

import dataclasses
import random
import re
import shutil
import subprocess

import pytest
from kv_canary.codegen.comments import comment_text
from kv_canary.codegen.diagnostics import SchemaError
from kv_canary.codegen.limits import MAX_NAME_CHARS
from kv_canary.codegen.load import load_schema, load_schema_text
from kv_canary.codegen.render import render_all, split_header
from support import scenarios
from support.kernel_diff import compare
from support.trees import DEFAULT_SCHEMA, default_schema_text, generate_tree, scratch_dir

import kv_canary
from kv_canary.trees.emulation_build import INCLUDE_DIRS, SHIM_DIR
from kv_canary.trees.sources import kernel_abi, read_source, tree_dir

GXX = shutil.which("g++")
needs_gxx = pytest.mark.skipif(GXX is None, reason="g++ not installed")

LONG_KERNEL_NAME = "scatter_" + "x" * (MAX_NAME_CHARS - len("scatter_"))  # the longest name the schema allows


def named_schema_text(names: dict[str, str]) -> str:
    """kernels.yaml (stride 64) with every kind of schema name taken from `names`: extra constants,
    an input field of each verify source, a reserved field, extra flag and enum sets, two FailReason
    members, a renamed launch tag and all five kernels renamed."""
    text = default_schema_text(stride=64)

    def sub(old: str, new: str) -> None:
        nonlocal text
        assert text.count(old) == 1, old
        text = text.replace(old, new)

    n = names
    sub("constants:\n", "constants:\n" + "".join(f"  {c}: {{type: i32, value: {i + 1}, doc: \"a constant\"}}\n"
                                                 for i, c in enumerate(n["constants"])))
    sub("      - {name: real_kv_hash, role: kv_fingerprint}\n",
        "      - {name: real_kv_hash, role: kv_fingerprint}\n"
        f"      - {{name: {n['request_field']}, role: input, source: request_id, "
        f"verify: {{expected: per_request, fail_reason: {n['reason_a']}}}}}\n"
        f"      - {{name: {n['slot_field']}, role: input, source: allocation_epoch, "
        f"verify: {{expected: per_slot, fail_reason: {n['reason_b']}}}}}\n"
        f"      - {{name: {n['reserved_field']}, role: reserved}}\n")
    sub("fold: [token, position]", f"fold: [token, position, {n['request_field']}]")
    sub("    SLOT_OUT_OF_RANGE: 64\n",
        "    SLOT_OUT_OF_RANGE: 64\n"
        f"    {n['reason_a']}: {{value: 128, kind: verify}}\n    {n['reason_b']}: {{value: 256, kind: verify}}\n"
        f"  {n['flag_set']}:\n" + "".join(f"    {m}: {{value: {1 << i}}}\n" for i, m in enumerate(n["flag_members"])))
    sub("  RealKvHashMode: {NONE: 0, PARTIAL: 1, ALL: 2}\n",
        "  RealKvHashMode: {NONE: 0, PARTIAL: 1, ALL: 2}\n"
        f"  {n['enum_set']}: {{" + ", ".join(f"{m}: {i}" for i, m in enumerate(n["enum_members"])) + "}\n")
    sub("  HEAD_K_FULL: {value: 0,", f"  {n['launch_tag']}: {{value: 0,")
    for old, new in zip(("canary_write", "canary_verify", "canary_plan_offsets", "canary_plan_entries",
                         "canary_scatter_req_token_ids"), n["kernels"]):
        sub(f"  - name: {old}\n", f"  - name: {new}\n")
    return text


# Names that are macros of the emulated build (errno.h, sys/mman.h, time.h, stdio.h, limits.h, ...),
# libc and CUDA functions, and the names of kv-canary's own shim and generated header: the kernels
# are named like the shim's extern "C" kvc_emu_last_error, the header's kvc_i64 typedef and kvc
# namespace, and `kv` (once next to the verify kernel's own kv_launch namespace).
HOSTILE = dict(
    constants=["ENOMEM", "PROT_READ", "CLOCK_MONOTONIC", "NULL", "EOF", "INT_MAX", "SIZE_MAX", "errno", "stdin",
               "abort", "printf", "atomicAdd", "threadIdx", "warpSize", "CHAIN_HEAD", "FIELD_TOKEN_WORD",
               "FailReason_SLOT_OUT_OF_RANGE", "TOKEN_WORD", "RealKvSources", "ring_append", "kvc", "kvc_emu",
               "kvc_u64", "KVC_EMU_ASAN", "KV_CANARY_HOST_EMULATION", "MAP_FAILED", "SIGSEGV", "linux", "unix"],
    request_field="ENOMEM", slot_field="PROT_READ", reserved_field="errno",
    reason_a="EINVAL", reason_b="EOF",
    flag_set="PROT_WRITE", flag_members=["MAP_SHARED", "NULL", "kvc_i64"],
    enum_set="CLOCK_REALTIME", enum_members=["SEEK_SET", "ENOMEM", "stdout"],
    launch_tag="EXIT_SUCCESS",
    kernels=["kvc_emu_last_error", "kvc_i64", "kvc", "kv", LONG_KERNEL_NAME],
)
SENTINEL = "zq"
PROBE = dict(
    constants=["ZQ_CONST"], request_field="zq_request", slot_field="zq_slot", reserved_field="zq_reserved",
    reason_a="ZQ_REASON_A", reason_b="ZQ_REASON_B", flag_set="ZqFlags", flag_members=["ZQ_FLAG"],
    enum_set="ZqEnum", enum_members=["ZQ_ENUM"], launch_tag="ZQ_TAG",
    kernels=["zq_write", "zq_verify", "zq_plan_offsets", "zq_plan_entries", "zq_scatter"],
)


def _tree(names: dict, stem: str):
    path = scratch_dir("kv_canary_c_names_") / f"{stem}.yaml"
    path.write_text(named_schema_text(names), encoding="utf-8")
    return generate_tree(path)


@pytest.fixture(scope="module")
def hostile_tree():
    return _tree(HOSTILE, "hostile")


@pytest.fixture(scope="module")
def probe_tree():
    return _tree(PROBE, "probe")


def _c_sources(tree) -> dict[str, str]:
    root = tree_dir(tree)
    return {p.relative_to(root).as_posix(): p.read_text(encoding="utf-8")
            for p in sorted(root.rglob("*")) if p.suffix in (".cu", ".cuh", ".cpp")}


_NOT_CODE = re.compile(r'"(?:\\.|[^"\\\n])*"|//[^\n]*|/\*.*?\*/', re.S)


def _identifiers(c_text: str) -> set[str]:
    """The identifiers of C++ source text (string literals and comments removed)."""
    return set(re.findall(r"\b[A-Za-z_]\w*\b", _NOT_CODE.sub(" ", c_text)))


def _visible_macros(tree) -> set[str]:
    """Every macro defined at the end of the emulation library's translation unit."""
    source = tree_dir(tree) / kernel_abi(tree).EMULATION_SOURCE
    proc = subprocess.run([GXX, "-std=c++17", "-dM", "-E", *(f"-I{d}" for d in INCLUDE_DIRS), str(source)],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    return set(re.findall(r"^#define (\w+)", proc.stdout, re.M))


def test_schema_names_are_not_c_names():
    """The hostile names pass the schema's rules: nothing in C or C++ reserves them any more."""
    load_schema_text(named_schema_text(HOSTILE))


def test_an_entry_point_shared_by_two_kernels_is_refused():
    names = dict(HOSTILE, kernels=["w", "v", "kv", "v_check_verify_expected_token", "kvc"])
    with pytest.raises(SchemaError, match=r"error: kernel 'v_check_verify_expected_token' and kernel 'v' would both "
                                          r"export the entry point 'v_check_verify_expected_token'"):
        load_schema_text(named_schema_text(names))


@needs_gxx
def test_every_schema_name_reaches_c_behind_a_prefix_no_macro_uses(probe_tree):
    prefixes = set()
    for path, text in _c_sources(probe_tree).items():
        for ident in (i for i in _identifiers(split_header(text)[1]) if SENTINEL in i.lower()):
            prefix = ident[:ident.lower().index(SENTINEL)]
            assert prefix, f"{path}: the schema name {ident} reaches C without a prefix"
            prefixes.add(prefix)
    # Every kind of name the probe declares shows up (so the probe covers what the templates emit).
    assert {"kvc_const_", "kvc_field_", "kvc_set_", "kvc_member_", "kvcanary_", "extra_input_",
            "verify_expected_", "slot_table_", "request_value_"} <= prefixes, prefixes
    macros = _visible_macros(probe_tree)
    assert len(macros) > 500 and {"ENOMEM", "PROT_READ", "CLOCK_MONOTONIC", "NULL"} <= macros  # the headers are seen
    clashes = sorted(m for m in macros for p in prefixes if m.startswith(p))
    assert not clashes, f"macros of the emulated build start with a schema-name prefix: {clashes}"


@needs_gxx
def test_the_shim_defines_no_macro_a_kernel_could_trip_on():
    """What is left as macros: the CUDA qualifiers our kernels use and the host-emulation switch."""
    text = (SHIM_DIR / "cuda_host_shim.h").read_text(encoding="utf-8")
    defined = set(re.findall(r"^\s*#\s*define\s+(\w+)", text, re.M))
    undefined = set(re.findall(r"^\s*#\s*undef\s+(\w+)", text, re.M))
    assert defined - undefined == {"KV_CANARY_HOST_EMULATION", "__device__", "__global__", "__forceinline__",
                                   "__launch_bounds__", "__shared__"}


def test_entry_points_are_prefixed_and_listed_by_the_kernel_abi(hostile_tree):
    abi = kernel_abi(hostile_tree)
    symbols = [symbol for k in abi.KERNELS.values() for symbol, _ in k.variants]
    assert symbols == ["kvcanary_kvc_emu_last_error", "kvcanary_kvc_i64", "kvcanary_kvc_i64_check_verify_expected_token",
                       "kvcanary_kvc", "kvcanary_kv", "kvcanary_" + LONG_KERNEL_NAME]
    assert all(s.startswith(abi.ENTRY_POINT_PREFIX) for s in symbols)
    for kernel in abi.KERNELS.values():
        source = read_source(hostile_tree, kernel.source)
        for symbol, _ in kernel.variants:
            assert re.search(rf'extern "C" __global__ void __launch_bounds__\(\d+\) {symbol}\(', source), symbol


@needs_gxx
def test_a_schema_named_after_c_names_builds_and_runs_like_the_reference(hostile_tree):
    kv_canary.runtime_for(hostile_tree).backend("emulated")   # g++ builds it (-Wall -Wextra -Werror)
    for kind, make in (("write", scenarios.make_write_case), ("verify", scenarios.make_verify_case),
                       ("plan", scenarios.make_plan_case), ("scatter", scenarios.make_scatter_case)):
        for seed in range(4):
            compare(hostile_tree, kind, make(random.Random(seed), hostile_tree), "emulated", ordered=True)


def test_a_schema_named_after_c_names_compiles_with_nvrtc(hostile_tree):
    pytest.importorskip("cupy_backends.cuda.libs.nvrtc", reason="NVRTC bindings (cupy-cuda13x) not installed")
    from kv_canary.trees import nvrtc
    abi = kernel_abi(hostile_tree)
    headers = {"kv_canary_layout.cuh": read_source(hostile_tree, abi.HEADER)}
    for kernel in abi.KERNELS.values():
        # Through the project's compile cache (by content), as the runtime compiles.
        cubin = nvrtc.cached_binary(read_source(hostile_tree, kernel.source), kernel.source, headers, arch=90).read_bytes()
        for symbol, _ in kernel.variants:
            assert symbol.encode() + b"\0" in cubin, symbol


# -- schema text in comments -------------------------------------------------------------------------
@pytest.mark.parametrize("text, want", [
    ("plain text", "plain text"),
    ("line\nbreak", "line<U+000A>break"),
    ("trojan \u202esource\u2066", "trojan <U+202E>source<U+2066>"),
    ("zero\u200bwidth\u2028sep", "zero<U+200B>width<U+2028>sep"),
    ("trigraph ??/ and ??= but ?? alone", "trigraph <U+003F>?/ and <U+003F>?= but ?? alone"),
    ("continues\\", "continues<U+005C>"),
    ("ends */ and -->", "ends *<U+002F> and --<U+003E>"),
    ("unicode é 中 stays", "unicode é 中 stays"),
])
def test_comment_text_escapes_what_could_end_or_disguise_a_comment(text, want):
    assert comment_text(text) == want


def test_renderers_escape_docs_the_parser_would_let_through():
    """The renderers do not rely on the parser: a model whose doc holds a line break, a bidi override,
    a trigraph and a trailing backslash renders one harmless comment line in C++ and in Python."""
    schema = load_schema(DEFAULT_SCHEMA)
    evil = "x\nimport os ??/ \u202e\\"
    constants = tuple(dataclasses.replace(c, doc=evil) if c.name == "REQ_POOL_IDX_PADDING" else c
                      for c in schema.constants)
    files = {f.path: split_header(f.text)[1] for f in render_all(dataclasses.replace(schema, constants=constants), "")}
    cuh = [line for line in files["cuda/kv_canary_layout.cuh"].splitlines() if "kvc_const_REQ_POOL_IDX_PADDING =" in line]
    py = [line for line in files["layout.py"].splitlines() if line.startswith("REQ_POOL_IDX_PADDING =")]
    assert cuh == ["constexpr long long kvc_const_REQ_POOL_IDX_PADDING = 0LL;  // " + comment_text(evil)]
    assert py == ["REQ_POOL_IDX_PADDING = 0  # " + comment_text(evil)]
    assert not any(line.startswith("import os ??") for line in files["layout.py"].splitlines())
