"""Semantic checks on a parsed schema. Every problem is collected; none stops the others."""
from __future__ import annotations

import builtins
import dataclasses
import keyword
import re

from .diagnostics import Diagnostics, Loc, closest_hint, closest_name, quote
from .facts import supplied
from .kernel_abi import duplicate_params
from .limits import MAX_NAME_CHARS, check_limits
from .model import (
    BUILTIN_CONSTANTS,
    BUILTIN_FAIL_REASON_KINDS,
    CHAINABLE_ROLES,
    CONSTANT_TYPES,
    INPUT_VALUE_SOURCES,
    LAUNCH_HALVES,
    LAUNCH_PHASES,
    LAUNCH_TAG_ENUM,
    REAL_KV_LOAD_BYTES,
    REQUIRED_CANARY_ROLES,
    REQUIRED_CONSTANTS,
    REQUIRED_ENUMS,
    REQUIRED_FLAGS,
    REQUIRED_LAUNCH_GROUP,
    STEP_HALVES,
    STEP_PHASES,
    VIOLATION_CARRIES,
    Schema,
    block_per_request_shared_memory,
    max_block_per_request_threads,
)
from .operations import KERNEL_TEMPLATES, kernel_params

# Identifiers valid in both Python and C++. Restricting names to this pattern is also what keeps
# schema text from injecting code into the generated sources.
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
# C++ no longer needs these (every schema name reaches C++ behind a prefix, see below); they
# stay reserved because several are Python builtins the generated Python calls (bool, int, float):
# a constant of that name in layout.py would shadow them.
CPP_KEYWORDS = frozenset("""
alignas alignof and and_eq asm auto bitand bitor bool break case catch char char8_t char16_t
char32_t class compl concept const consteval constexpr constinit const_cast continue co_await
co_return co_yield decltype default delete do double dynamic_cast else enum explicit export extern
false float for friend goto if inline int long mutable namespace new noexcept not not_eq nullptr
operator or or_eq private protected public register reinterpret_cast requires return short signed
sizeof static static_assert static_cast struct switch template this thread_local throw true try
typedef typeid typename union unsigned using virtual void volatile wchar_t while xor xor_eq
""".split())
# Names the generated Python uses at the same scope; a schema name equal to one would shadow it.
# `mro` cannot name an enum member; u64 and i64 are the schema's own type names.
RESERVED_NAMES = frozenset({"self", "cls", "torch", "math", "enum", "typing", "u64", "i64", "mro",
                            # the generated package's modules (`tree.api`, ...): a constant of that
                            # name, re-exported by the package, would hide the module
                            "layout", "validators", "allocators", "reference", "api", "kernel_abi"})

# C and C++ need no list of reserved names. A macro ignores namespaces, and a kernel is an extern "C"
# symbol, so instead every identifier the generator derives from a schema name is spelled with a
# prefix that no C/C++/CUDA header and no part of kv-canary's shim uses: `kvc_const_<constant>`,
# `kvc_field_<field>_*`, `kvc_set_<set>::kvc_member_<member>` in the layout header, parameters
# `extra_input_<field>` / `verify_expected_<field>` / `slot_table_<field>` / `request_value_<field>`,
# and entry points `kvcanary_<kernel>` (codegen.kernel_abi.ENTRY_POINT_PREFIX). Kinds never share a
# scope, and fixed names never carry these prefixes. tests/codegen/test_c_names.py checks the prefixes
# against every macro the emulated build sees, and builds schemas named after macros (ENOMEM,
# PROT_READ, ...), libc functions and kv-canary's own C names.

# Module-level names layout.py.j2 defines besides the schema's constants and flag/enum sets.
LAYOUT_FIXED_NAMES = frozenset({
    "ABI_VERSION", "LAYOUT_FINGERPRINT", "CANARY_CHAIN_HEAD", "UNKNOWN", "CANARY_WORD_BYTES", "CANARY_FIELDS_PER_SLOT",
    "CANARY_RECORD_BYTES", "CANARY_SLOT_STRIDE_BYTES", "CANARY_FIELD_NAMES", "CANARY_FIELD_OFFSETS",
    "CANARY_TOKEN_WORD", "CANARY_POSITION_WORD", "CANARY_CHAIN_LINK_WORD", "CANARY_KV_FINGERPRINT_WORD",
    "CANARY_CHAIN_FOLD_WORDS", "CANARY_CHAIN_FOLD_NAMES", "InputField", "INPUT_FIELDS", "VIOLATION_FIELDS",
    "VIOLATION_FIELD_NAMES", "VIOLATION_CARRIES", "REAL_KV_SOURCE_FIELDS_PER_ENTRY", "MASK64", "splitmix64", "splitmix64_mix3",
    "to_signed64", "dataclass", "Optional", "annotations", "enum", "numbers", "operator",
    "VIOLATION_REASON_COUNT_NAMES", "VIOLATION_REASON_COUNT_BITS", "VIOLATION_REASON_COUNT_COLUMNS",
    "LAUNCH_PHASES", "LAUNCH_HALVES", "LAUNCH_GROUPS", "LAUNCH_TAG_COORDINATES", "LAUNCH_TAG_BY_COORDINATES",
    *STEP_PHASES, *STEP_HALVES, "launch_tag", "FAIL_REASON_KINDS", "VERIFY_REASON_BITS", "WRITE_REASON_BITS", "TOKEN_REASON_BITS",
    "MESSAGE_PREFIX", "MESSAGES", "message", "fail",
})

# Names the generated package's __init__.py defines beside `from .layout import *` (python/__init__.py.j2):
# a schema name equal to one would replace it, or be hidden by it, in the package.
PACKAGE_FIXED_NAMES = frozenset({"REGENERATE_COMMAND", "GENERATION_ID", "FILE_SHA256"})

PYTHON_BUILTINS = frozenset(dir(builtins))

MAX_FLAG_BIT = 62  # bits live in an int64 violation column; keep the sign bit clear
MAX_THREADS = 1024
# The real-KV loads are 16-byte vectors (kvc::load_u64x2, kvc::KvChunk); the header pins it too.


def check_name(d: Diagnostics, name: str, loc: Loc, what: str) -> bool:
    if len(name) > MAX_NAME_CHARS:
        d.error(loc, f"{what} {quote(name[:MAX_NAME_CHARS] + '...')} is {len(name)} characters long; at most "
                     f"{MAX_NAME_CHARS} are supported")
        return False
    if not _IDENT.match(name):
        d.error(loc, f"{what} '{name}' is not a valid identifier (letters, digits and '_', not starting "
                     f"with a digit)")
        return False
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in CPP_KEYWORDS:
        d.error(loc, f"{what} '{name}' is a reserved word in Python or C++")
        return False
    if name.startswith("_") or "__" in name:
        # C++ reserves '__' anywhere (a prefixed C name ends in '_', so a leading '_' would make one);
        # Python's `import *` skips '_' names.
        d.error(loc, f"{what} '{name}' must not start with '_' or contain '__'")
        return False
    if name in RESERVED_NAMES:
        d.error(loc, f"{what} '{name}' is reserved by the generated code")
        return False
    return True


def _generated_names(schema: Schema) -> dict[str, str]:
    """Every module-level name layout.py derives from the schema's records -> what defines it. (The
    C++ header needs no such table: its schema-derived names are prefixed per kind.)"""
    names = {n: "a fixed name of the generated layout" for n in LAYOUT_FIXED_NAMES}
    names.update({n: "a name of the generated package's __init__" for n in PACKAGE_FIXED_NAMES})
    names.update({n: "a constant the generator supplies" for n in BUILTIN_CONSTANTS})
    for f in schema.canary.fields:
        names[f"CANARY_FIELD_{f.name.upper()}"] = f"canary field '{f.name}'"
    for f in schema.violation.fields:
        names[f"VIOLATION_FIELD_{f.name.upper()}"] = f"violation field '{f.name}'"
        names[f"VIOLATION_COL_{f.carries.upper()}"] = f"violation field '{f.name}'"
    for f in schema.real_kv_source.fields:
        names[f"REAL_KV_SOURCE_FIELD_{f.name.upper()}"] = f"real_kv_source field '{f.name}'"
    return names


def _check_generated_names(schema: Schema, d: Diagnostics) -> None:
    # Field names become upper-case identifiers: 'token' and 'TOKEN' would define one name twice.
    for rec in (schema.canary, schema.violation):
        seen = {}
        for f in rec.fields:
            upper = f.name.upper()
            if upper in seen and seen[upper] != f.name:
                d.error(f.loc, f"field '{f.name}' and field '{seen[upper]}' differ only in case; both would "
                               f"generate {rec.name.upper()}_FIELD_{upper}")
            seen.setdefault(upper, f.name)
    generated = _generated_names(schema)
    # Constants and flag/enum sets share one namespace: layout.py's module level (re-exported by the
    # package). The later of two same-named definitions would silently replace the earlier one there.
    # Duplicates within a kind are _duplicates' (constants, sets); this catches a pair across kinds.
    defined: dict[str, tuple[str, Loc]] = {}
    items = sorted([(c, "constant") for c in schema.constants if c.name not in BUILTIN_CONSTANTS] +
                   [(vs, f"{vs.kind} set") for vs in schema.flags + schema.enums],
                   key=lambda pair: (pair[0].loc.line, pair[0].loc.col))
    for item, what in items:
        first = defined.setdefault(item.name, (what, item.loc))
        if first[1] != item.loc and first[0] != what:
            d.error(item.loc, f"{what} '{item.name}' has the name of the {first[0]} defined at line "
                              f"{first[1].line}: both would be {item.name} in the generated layout module; "
                              f"rename one")
            continue
        if item.name in generated:
            d.error(item.loc, f"{what} '{item.name}' collides with the generated name {item.name} "
                              f"({generated[item.name]}); rename it")
        elif item.name in PYTHON_BUILTINS:
            # It becomes a module-level name of generated/layout.py, whose own code calls the builtins.
            d.error(item.loc, f"{what} '{item.name}' would shadow the Python builtin {item.name} in the generated "
                              f"layout module; rename it")


def _duplicates(d: Diagnostics, items, what: str, key=lambda x: x.name) -> None:
    seen = {}
    for item in items:
        k = key(item)
        if k in seen:
            d.error(item.loc, f"duplicate {what} '{k}' (first defined at line {seen[k].line})")
        else:
            seen[k] = item.loc


def check_schema(schema: Schema, d: Diagnostics) -> None:
    _check_constants(schema, d)
    _check_canary(schema, d)
    _check_other_records(schema, d)
    _check_value_sets(schema, d)
    _check_fail_reason_kinds(schema, d)
    _check_launch_tags(schema, d)
    _check_kernels(schema, d)
    _check_kernel_file_names(schema, d)
    _check_generated_names(schema, d)
    check_limits(schema, d)


# Device names that Windows refuses as file names, whatever the extension.
_WINDOWS_DEVICE_NAMES = frozenset(["CON", "PRN", "AUX", "NUL"] +
                                  [f"{p}{i}" for p in ("COM", "LPT") for i in range(1, 10)])


def _check_kernel_file_names(schema: Schema, d: Diagnostics) -> None:
    """Kernel names become file names (generated/cuda/<name>.cu): they must not collide on a
    case-insensitive file system (macOS, Windows) nor be a reserved device name."""
    seen = {}
    for k in schema.kernels:
        if k.name.upper() in _WINDOWS_DEVICE_NAMES:
            d.error(k.loc, f"kernel name '{k.name}' is a reserved device name on Windows (it names the file "
                           f"cuda/{k.name}.cu); rename it")
        first = seen.setdefault(k.name.lower(), k)
        if first is not k and first.name != k.name:
            d.error(k.loc, f"kernel '{k.name}' and kernel '{first.name}' differ only in case; their files "
                           f"cuda/{k.name}.cu and cuda/{first.name}.cu are one file on a case-insensitive file system")


def _check_constants(schema: Schema, d: Diagnostics) -> None:
    for c in schema.constants:
        check_name(d, c.name, c.loc, "constant name")
        _, lo, hi = CONSTANT_TYPES[c.type]
        if not lo <= c.value <= hi:
            d.error(c.where.get("value", c.loc),
                    f"constant '{c.name}' value {c.value} does not fit its type {c.type} [{lo}, {hi}]")
    _duplicates(d, schema.constants, "constant")
    names = {c.name: c for c in schema.constants}
    for name, ctype in REQUIRED_CONSTANTS.items():
        if name not in names:
            d.error(schema.section_loc("constants"), f"missing required constant '{name}' of type {ctype}")
        elif names[name].type != ctype:
            d.error(names[name].where.get("type", names[name].loc),
                    f"constant '{name}' must have type {ctype}, got {names[name].type}")
    # Any such value is at most the largest valid num_bytes_per_token (a C int, multiple of 16), so no
    # schema alone makes PARTIAL read past every source: a source with fewer bytes per slot is refused
    # by the launch's validation (kv_canary/launch/operations.py, validation.py check_partial_read).
    partial = names.get("REAL_KV_PARTIAL_READ_BYTES")
    if partial is not None and (partial.value <= 0 or partial.value % REAL_KV_LOAD_BYTES):
        d.error(partial.where.get("value", partial.loc),
                f"REAL_KV_PARTIAL_READ_BYTES must be a positive multiple of REAL_KV_LOAD_ALIGN_BYTES="
                f"{REAL_KV_LOAD_BYTES}, got {partial.value}")
    mx = names.get("MAX_REAL_KV_SOURCES")
    if mx is not None and not 1 <= mx.value <= 16:
        d.error(mx.where.get("value", mx.loc), f"MAX_REAL_KV_SOURCES must be in [1, 16], got {mx.value}")


def _check_canary(schema: Schema, d: Diagnostics) -> None:
    rec = schema.canary
    if rec.word != "int64":
        d.error(rec.where.get("word", rec.loc), f"record 'canary' word must be int64, got {rec.word}")
    for f in rec.fields:
        check_name(d, f.name, f.loc, "field name")
    _duplicates(d, rec.fields, "field")
    for role in REQUIRED_CANARY_ROLES:
        holders = [f for f in rec.fields if f.role == role]
        if not holders:
            d.error(rec.where.get("fields", rec.loc), f"record 'canary' has no field with required role '{role}'")
        for extra in holders[1:]:
            d.error(extra.where.get("role", extra.loc),
                    f"role '{role}' is already held by field '{holders[0].name}'; a record has one '{role}' field")
    stride = rec.stride_bytes
    stride_loc = rec.where.get("slot_stride_bytes", rec.loc)
    if stride <= 0 or stride % 8:
        d.error(stride_loc, f"slot_stride_bytes must be a positive multiple of 8, got {stride}")
    elif rec.record_bytes > stride:
        last = rec.fields[stride // 8] if len(rec.fields) > stride // 8 else rec.fields[-1]
        d.error(last.loc, f"field '{last.name}' at byte offset {last.offset} does not fit the slot stride of "
                          f"{stride} bytes ({len(rec.fields)} fields need {rec.record_bytes} bytes)")
    flags = {m.name for fs in schema.flags if fs.name == "FailReason" for m in fs.members}
    for f in rec.fields:
        if f.verify is not None and f.verify.fail_reason not in flags:
            d.error(f.verify.loc, f"field '{f.name}' verify fail_reason '{f.verify.fail_reason}' is not a "
                                  f"FailReason member{closest_hint(f.verify.fail_reason, sorted(flags), 0.9)}")
    builtin_bits = set(REQUIRED_FLAGS["FailReason"])
    used = {}
    for f in rec.fields:
        if f.verify is None:
            continue
        r = f.verify.fail_reason
        if r in builtin_bits:
            d.error(f.verify.loc, f"field '{f.name}' verify fail_reason '{r}' is a built-in reason; "
                                  f"declare a FailReason bit of its own")
        elif r in used:
            d.error(f.verify.loc, f"fail_reason '{r}' is already used by field '{used[r]}'")
        used[r] = f.name
    _check_input_sources(schema, d)
    chain = rec.chain
    if chain is None:
        return
    anchor = next((c for c in schema.constants if c.name == chain.anchor), None)
    if anchor is None:
        d.error(chain.where.get("anchor", chain.loc), f"chain anchor '{chain.anchor}' is not a declared constant")
    elif anchor.type != "u64":
        d.error(chain.where.get("anchor", chain.loc),
                f"chain anchor '{chain.anchor}' must be a u64 constant, got {anchor.type}")
    by_name = {}
    for f in rec.fields:
        by_name.setdefault(f.name, f)  # a duplicate name is reported once, above
    if not chain.fold:
        d.error(chain.where.get("fold", chain.loc), "chain fold must name at least one field")
    seen = set()
    for name, loc in zip(chain.fold, chain.fold_locs):
        f = by_name.get(name)
        if f is None:
            d.error(loc, f"chain fold names unknown field '{name}'")
        elif f.role not in CHAINABLE_ROLES:
            d.error(loc, f"chain fold names field '{name}' with role '{f.role}', which cannot be chained "
                         f"(chainable roles: {', '.join(CHAINABLE_ROLES)})")
        if name in seen:
            d.error(loc, f"chain fold names field '{name}' twice")
        seen.add(name)


def _check_input_sources(schema: Schema, d: Diagnostics) -> None:
    """An input field's value source must be one the runtime can check against its `expected`."""
    reasons = {m.name: m for fs in schema.flags if fs.name == "FailReason" for m in fs.members}
    for f in schema.canary.input_fields:
        if not f.source or f.verify is None:
            continue
        allowed = INPUT_VALUE_SOURCES[f.source]
        if f.verify.expected not in allowed:
            d.error(f.verify.where.get("expected", f.verify.loc),
                    f"field '{f.name}' has source '{f.source}', which the runtime can only check with expected: "
                    f"{' or '.join(allowed)}, got '{f.verify.expected}'")
        member = reasons.get(f.verify.fail_reason)
        if member is not None and member.kind and member.kind != "verify":
            d.error(f.verify.loc, f"field '{f.name}' verify fail_reason '{member.name}' has kind '{member.kind}'; "
                                  f"a verified input field's mismatch is raised by verify launches, so its kind "
                                  f"must be 'verify'")


def _check_other_records(schema: Schema, d: Diagnostics) -> None:
    vio = schema.violation
    if vio.word != "int64":
        d.error(vio.where.get("word", vio.loc), f"record 'violation' word must be int64, got {vio.word}")
    for f in vio.fields:
        check_name(d, f.name, f.loc, "field name")
    _duplicates(d, vio.fields, "field")
    _duplicates(d, vio.fields, "violation column for", key=lambda f: f.carries)
    carried = {f.carries for f in vio.fields}
    for c in VIOLATION_CARRIES:
        if c not in carried:
            d.error(vio.where.get("fields", vio.loc), f"record 'violation' has no field that carries '{c}'")


def _check_value_sets(schema: Schema, d: Diagnostics) -> None:
    all_sets = schema.flags + schema.enums
    for vs in all_sets:
        check_name(d, vs.name, vs.loc, f"{vs.kind} set name")
        for m in vs.members:
            check_name(d, m.name, m.loc, f"{vs.kind} member name")
        _duplicates(d, vs.members, f"member of '{vs.name}'")
        if not vs.members:
            d.error(vs.loc, f"{vs.kind} set '{vs.name}' has no members")
    # A declared set named like a generated one is reported once, by _check_launch_tags.
    _duplicates(d, [vs for vs in all_sets if not vs.generated_from], "flag or enum set")
    for fs in schema.flags:
        seen = {}
        for m in fs.members:
            if m.value <= 0 or m.value & (m.value - 1) or m.value.bit_length() - 1 > MAX_FLAG_BIT:
                d.error(m.loc, f"flag '{fs.name}.{m.name}' value {m.value} is not a single bit in "
                               f"[1, 2^{MAX_FLAG_BIT}]")
            elif m.value in seen:
                d.error(m.loc, f"flag '{fs.name}.{m.name}' reuses bit value {m.value} of '{seen[m.value]}'")
            else:
                seen[m.value] = m.name
    for es in schema.enums:
        seen = {}
        for m in es.members:
            if not -(1 << 31) <= m.value < (1 << 31):
                d.error(m.loc, f"enum '{es.name}.{m.name}' value {m.value} does not fit int32")
            elif m.value in seen:
                d.error(m.loc, f"enum '{es.name}.{m.name}' value {m.value} collides with '{seen[m.value]}'")
            else:
                seen[m.value] = m.name
    for required, table, kind in ((REQUIRED_FLAGS, schema.flags, "flag"), (REQUIRED_ENUMS, schema.enums, "enum")):
        present = {vs.name: vs for vs in table}
        for name, members in required.items():
            if name not in present:
                d.error(schema.section_loc(kind + "s"), f"missing required {kind} set '{name}'")
                continue
            have = {m.name for m in present[name].members}
            for member in members:
                if member not in have:
                    d.error(present[name].loc, f"{kind} set '{name}' is missing required member '{member}'")


def _check_fail_reason_kinds(schema: Schema, d: Diagnostics) -> None:
    """Every FailReason member says which launches raise it; other flag sets take no kind."""
    restated = []
    for fs in schema.flags:
        for m in fs.members:
            if fs.name != "FailReason":
                if m.kind:
                    d.error(m.where.get("kind", m.loc), f"flag '{fs.name}.{m.name}' takes no kind (only FailReason "
                                                        f"members say which launches raise them)")
                continue
            fixed = BUILTIN_FAIL_REASON_KINDS.get(m.name)
            if not m.kind:  # the parser supplies a built-in reason's kind
                d.error(m.loc, f"FailReason member '{m.name}' must say which launches raise it: "
                               f"{{value: {m.value}, kind: verify}} (kinds: verify, write, both)")
            elif fixed is not None and m.kind != fixed:
                d.error(m.where.get("kind", m.loc), f"FailReason member '{m.name}' is raised by "
                                                    f"{'both verify and write' if fixed == 'both' else fixed} "
                                                    f"launches: its kind must be '{fixed}', got '{m.kind}'"
                                                    f"{supplied('the kinds of built-in reasons', m.loc, 'the kind')}")
            elif fixed is not None and "kind" in m.where:
                restated.append(m)
    if restated:
        d.note(restated[0].loc, f"the kinds of the built-in fail reasons are supplied by the generator; "
                                f"{len(restated)} stated here can be removed (write {restated[0].name}: "
                                f"{restated[0].value})")


def _check_launch_tags(schema: Schema, d: Diagnostics) -> None:
    """Every pool group gets one tag per phase and K/V half; the full-attention group is required."""
    tags = schema.launch_tags
    for vs in schema.flags + schema.enums:
        if vs.name == LAUNCH_TAG_ENUM and not vs.generated_from:
            d.error(vs.loc, f"{vs.kind} '{LAUNCH_TAG_ENUM}' is generated from launch_tags; remove it from "
                            f"{vs.kind}s")
    if not tags:
        d.error(schema.section_loc("launch_tags"), "launch_tags declares no tag; the manager needs one per phase "
                                                   "(head, tail, sweep) and K/V half of every pool group")
        return
    seen: dict = {}
    for t in tags:
        check_name(d, t.group, t.where.get("group", t.loc), "launch tag group")
        first = seen.setdefault(t.coordinates, t)
        if first is not t:
            d.error(t.loc, f"launch tag '{t.name}' has the same phase, half and group ({t.phase}, {t.half}, "
                           f"{t.group}) as '{first.name}'; each launch has one tag")
    for group in schema.launch_groups:
        where = next(t for t in tags if t.group == group)
        missing = [f"{p}/{h}" for p in LAUNCH_PHASES for h in LAUNCH_HALVES if (p, h, group) not in seen]
        if missing:
            d.error(where.where.get("group", where.loc),
                    f"pool group '{group}' has no launch tag for {', '.join(missing)}; the manager launches every "
                    f"phase (head, tail, sweep) on both K/V halves of a group")
    if REQUIRED_LAUNCH_GROUP not in schema.launch_groups:
        d.error(schema.section_loc("launch_tags"),
                f"launch_tags must declare group '{REQUIRED_LAUNCH_GROUP}' (the full-attention KV pool every engine "
                f"has), got groups {', '.join(schema.launch_groups)}")


def _check_entry_points(schema: Schema, d: Diagnostics) -> None:
    """A specialisation's entry point is the kernel's name + a suffix: it must not be another kernel's."""
    owner = {}
    for k in schema.kernels:
        for symbol, _ in k.variants:
            first = owner.setdefault(symbol, k)
            if first is not k and first.name != k.name:  # same-name kernels are reported as duplicates
                d.error(k.loc, f"kernel '{k.name}' and kernel '{first.name}' would both export the entry point "
                               f"'{symbol}' (a kernel's name followed by a specialisation's); rename one of them")


def _check_kernels(schema: Schema, d: Diagnostics) -> None:
    _duplicates(d, schema.kernels, "kernel")
    _check_entry_points(schema, d)
    for k in schema.kernels:
        check_name(d, k.name, k.loc, "kernel name")
        spec = KERNEL_TEMPLATES.get(k.operation)
        if spec is None:
            d.error(k.where.get("operation", k.loc), f"kernel '{k.name}' uses unknown operation '{k.operation}'"
                                                     f"{closest_hint(k.operation, KERNEL_TEMPLATES)}; "
                                                     f"known operations: {', '.join(KERNEL_TEMPLATES)}")
            continue
        launch = k.launch
        if launch.shape not in spec.shapes:
            d.error(launch.where.get("shape", launch.loc),
                    f"kernel '{k.name}' (operation '{k.operation}') cannot use launch shape '{launch.shape}'; "
                    f"allowed: {', '.join(spec.shapes)}")
        if not 1 <= launch.threads <= MAX_THREADS:
            d.error(launch.where.get("threads", launch.loc),
                    f"kernel '{k.name}' launch threads must be in [1, {MAX_THREADS}], got {launch.threads}")
        elif launch.shape == "block_per_request" and launch.threads % 32:
            d.error(launch.where.get("threads", launch.loc),
                    f"kernel '{k.name}' launch shape 'block_per_request' loads fingerprints per warp, so threads "
                    f"must be a multiple of 32, got {launch.threads}")
        elif launch.shape == "block_per_request" and \
                not (smem := block_per_request_shared_memory(schema.canary, launch.threads)).fits:
            most = max_block_per_request_threads(schema.canary, MAX_THREADS)
            fix = (f"use at most {most} threads" if most else "no thread count fits; use launch shape 'per_request'")
            d.error(launch.where.get("threads", launch.loc),
                    f"kernel '{k.name}' launch shape 'block_per_request' needs {smem.total_bytes} bytes of static "
                    f"shared memory with {launch.threads} threads ({smem.buffers} x {smem.staged_entries} staged entries "
                    f"of {smem.entry_bytes} bytes for the {len(schema.canary.fields)}-field record + "
                    f"{smem.stager_warps} warp tiles of {smem.tile_bytes} bytes), more than the {smem.limit_bytes} "
                    f"a block may declare; {fix}")
        elif k.warp_reduction and launch.threads % 32:
            d.error(launch.where.get("threads", launch.loc),
                    f"kernel '{k.name}' uses a warp reduction, so its thread count must be a multiple of 32, "
                    f"got {launch.threads}")
        if launch.shape == "persistent" and not 1 <= launch.blocks_per_sm <= 64:
            d.error(launch.where.get("blocks_per_sm", launch.loc),
                    f"kernel '{k.name}' launch blocks_per_sm must be in [1, 64], got {launch.blocks_per_sm}")
        if launch.shape == "fixed_grid" and not 1 <= launch.blocks <= 65535:
            d.error(launch.where.get("blocks", launch.loc),
                    f"kernel '{k.name}' launch blocks must be in [1, 65535], got {launch.blocks}")
        names = {s.name for s in k.specializations}
        for s in k.specializations:
            if s.name not in spec.specializations:
                allowed = ", ".join(spec.specializations) or "none"
                d.error(s.loc, f"kernel '{k.name}' (operation '{k.operation}') has no specialization '{s.name}'"
                               f"{closest_hint(s.name, spec.specializations)}; allowed: {allowed}")
                names.add(closest_name(s.name, spec.specializations))  # a misspelling: one error, not two
        for required in spec.specializations:
            if required not in names:
                d.error(k.loc, f"kernel '{k.name}' must declare specialization '{required}'")
    misspelt = {closest_name(k.operation, KERNEL_TEMPLATES) for k in schema.kernels}
    for operation in KERNEL_TEMPLATES:
        if not schema.kernels_by_operation(operation) and operation not in misspelt:
            d.error(schema.section_loc("kernels"), f"no kernel runs operation '{operation}'; every operation "
                                                   f"with a kernel needs exactly one")
        for extra in schema.kernels_by_operation(operation)[1:]:
            d.error(extra.where.get("operation", extra.loc),
                    f"operation '{operation}' is already run by kernel "
                    f"'{schema.kernels_by_operation(operation)[0].name}'")




def attach_kernel_params(schema: Schema, d: Diagnostics) -> Schema:
    """Every kernel's parameter list (codegen/kernel_abi.py), with names derived from input fields
    checked for collisions: a field named `tokens` would give the verify kernel and the VerifyPlan a
    second `verify_expected_tokens`, so it is an error at the field, never silently wrong code."""
    kernels = []
    for k in schema.kernels:
        params = kernel_params(schema, k)
        for name in dict.fromkeys(duplicate_params(params)):
            culprit = next((f for f in schema.canary.input_fields if name.endswith("_" + f.name)), None)
            where = culprit.loc if culprit is not None else k.loc
            what = f"field '{culprit.name}' would" if culprit is not None else "the schema would"
            d.error(where, f"{what} give kernel '{k.name}' a second parameter '{name}' (and, for a per_request "
                           f"field, a second VerifyPlan array); rename the field")
        kernels.append(dataclasses.replace(k, params=params))
    return dataclasses.replace(schema, kernels=tuple(kernels))
