"""The typed, frozen model of kernels.yaml.

Templates and checks only ever see these objects, never raw YAML. Everything a backend needs
(offsets, word indices, bit values, fold order, launch shapes) is computed here once so that
every generated language agrees by construction.
"""
from __future__ import annotations

from dataclasses import dataclass
from dataclasses import field as dc_field
from types import MappingProxyType
from typing import Mapping, Optional

from .diagnostics import Loc


def _where():
    """Per-key source locations of an entry (key -> Loc of its value); not part of equality."""
    return dc_field(default_factory=lambda: MappingProxyType({}), compare=False, hash=False, repr=False)


def where_of(node_entries) -> Mapping[str, Loc]:
    return MappingProxyType({k.value: v.loc for k, v in node_entries})

MASK64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """docs/semantics.md §2, on Python ints (used for derived constants such as the chain head)."""
    x &= MASK64
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & MASK64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & MASK64
    x ^= x >> 31
    return x


# Integer types a constant may declare: (C++ type, min, max).
CONSTANT_TYPES = {
    "i32": ("int", -(1 << 31), (1 << 31) - 1),
    "u32": ("unsigned int", 0, (1 << 32) - 1),
    "i64": ("long long", -(1 << 63), (1 << 63) - 1),
    "u64": ("unsigned long long", 0, (1 << 64) - 1),
}

WORD_TYPES = {"int64": 8, "int32": 4}

# Record roles of the canary record.
ROLE_TOKEN = "token"
ROLE_POSITION = "position"
ROLE_CHAIN_LINK = "chain_link"
ROLE_KV_FINGERPRINT = "kv_fingerprint"
ROLE_INPUT = "input"
ROLE_RESERVED = "reserved"
CANARY_ROLES = (ROLE_TOKEN, ROLE_POSITION, ROLE_CHAIN_LINK, ROLE_KV_FINGERPRINT, ROLE_INPUT, ROLE_RESERVED)
REQUIRED_CANARY_ROLES = (ROLE_TOKEN, ROLE_POSITION, ROLE_CHAIN_LINK, ROLE_KV_FINGERPRINT)
CHAINABLE_ROLES = (ROLE_TOKEN, ROLE_POSITION, ROLE_INPUT)

# What each violation-row column carries (docs/semantics.md §3, §5).
VIOLATION_CARRIES = (
    "launch_tag", "slot", "stored_position", "stored_token", "expected_token",
    "stored_chain_hash", "expected_aux", "fail_reason",
)

# Where the expected value of a verified input field comes from (docs/semantics.md §8).
INPUT_EXPECTED_SOURCES = ("per_request", "per_slot")

# What the runtime (CanaryManager) writes into an input field, and the `expected` each can be
# checked against (an empty tuple entry: the field may also be written and never verified).
INPUT_VALUE_SOURCES = {
    "request_id": ("per_request",),           # the id of the request that writes the slot
    "allocation_epoch": ("per_slot",),        # the allocator's epoch of the slot
    "caller_table": ("per_slot",),            # a per-slot table the caller hands the manager
    "request_input": ("per_request",),        # a per-request value the engine integration supplies
                                              # (request_inputs=fn(request) -> {field: int}): written as
                                              # the writer's, verified as every reader's, prefix hits too
}

# Launch tags (CanaryLaunchTag, stamped into every violation row): the coordinates of a launch in
# the manager's step protocol. Every pool group gets one tag per phase and K/V half.
LAUNCH_TAG_ENUM = "CanaryLaunchTag"
LAUNCH_PHASES = ("head", "tail", "sweep")
LAUNCH_HALVES = ("k", "v")
# What each phase and half is in the step protocol (the generated layout's STEP_* names, which the
# manager reads): the head verifies and writes before the forward pass (the prefix only), the tail
# after it (the prefix with its real K/V bytes), the sweep verifies every cached slot periodically;
# the V half is the second K/V buffer, which only models with separate V caches (MHA) have.
STEP_PHASES = {"STEP_BEFORE_FORWARD": "head", "STEP_AFTER_FORWARD": "tail", "STEP_SWEEP": "sweep"}
STEP_HALVES = {"STEP_V_HALF": "v"}
REQUIRED_LAUNCH_GROUP = "full"

# The built-in FailReason members, fixed by the kernels and supplied by the generator (a schema
# names them, nothing more): which launches raise each (the report and the decoder tell verify rows
# from write rows by it), and whether its check compares a token id with an expected one (a report
# then prints the expected token id, docs/semantics.md §9).
FAIL_REASON_KINDS = ("verify", "write", "both")
BUILTIN_FAIL_REASONS = (
    # (member, kind, compares a token id)
    ("VERIFY_CHAIN_HASH_MISMATCH", "verify", False),
    ("VERIFY_POSITION_MISMATCH", "verify", False),
    ("VERIFY_REAL_KV_HASH_MISMATCH", "verify", False),
    ("WRITE_TOKEN_MISMATCH", "write", True),
    ("WRITE_POSITION_MISMATCH", "write", False),
    ("VERIFY_TOKEN_MISMATCH", "verify", True),
    ("SLOT_OUT_OF_RANGE", "both", False),
)
BUILTIN_FAIL_REASON_KINDS = {name: kind for name, kind, _ in BUILTIN_FAIL_REASONS}
TOKEN_FAIL_REASONS = tuple(name for name, _, token in BUILTIN_FAIL_REASONS if token)

# Flag sets and enums the kernels depend on, with the members they must have.
REQUIRED_FLAGS = {
    "FailReason": tuple(BUILTIN_FAIL_REASON_KINDS),
}
REQUIRED_ENUMS = {
    "RealKvHashMode": ("NONE", "PARTIAL", "ALL"),
}
REQUIRED_CONSTANTS = {
    "REQ_POOL_IDX_PADDING": "i64",
    "TOKEN_TO_KV_SLOT_PADDING": "i64",
    "MAX_REAL_KV_SOURCES": "i32",
    "REAL_KV_PARTIAL_READ_BYTES": "i32",
}

# Facts the kernels fix, supplied by the generator (codegen/facts.py); a schema states none of
# them. The constants, as (type, value, doc, why the value is fixed):
REAL_KV_LOAD_BYTES = 16
BUILTIN_CONSTANTS = {
    "REAL_KV_LOAD_ALIGN_BYTES": ("i32", REAL_KV_LOAD_BYTES,
                                 "vector load width; read sizes and row strides are multiples of it",
                                 f"the kernels read real-KV bytes as {REAL_KV_LOAD_BYTES}-byte vector loads"),
}
# The real-KV source row the launchers pass per source: int32 words, in this order.
REAL_KV_SOURCE_WORD = "int32"
REAL_KV_SOURCE_FIELDS = ("page_size", "num_bytes_per_token", "read_bytes")


# The kernel templates codegen knows, with the launch shapes and specialisations each accepts, are
# the operation table's (codegen/operations.py KERNEL_TEMPLATES).

# Launch shapes and the keys each one takes besides `shape` and `threads`.
LAUNCH_SHAPES = {
    "per_request": (),        # one thread per request, ceil(n / threads) blocks
    "block_per_request": (),  # one block of `threads` per request (n blocks)
    "per_entry": (),          # one thread per entry, ceil(n / threads) blocks
    "single_block": (),       # one block
    "persistent": ("blocks_per_sm",),  # SM count x blocks_per_sm blocks, grid-stride loop
    "fixed_grid": ("blocks",),          # a fixed number of blocks (SGLang: 64 x 512)
}


# Static shared memory a CUDA block may declare without an opt-in, on every architecture.
STATIC_SHARED_MEMORY_BYTES = 48 * 1024
WARP_SIZE = 32
_KV_CHUNK_BYTES = 16  # kvc::KvChunk: one 16-byte vector load (two u64 words)


@dataclass(frozen=True)
class BlockSharedMemory:
    """Static shared memory of the write kernel's block_per_request shape (kv_canary/csrc/kvc_write.cuh).

    Warp 0 walks the chain; every other warp stages one entry per thread into a chunk (a one-warp
    block's warp does both, over 32 entries). Chunks are double-buffered, so that chunk k+1 is
    staged while chunk k is walked, and each staging warp has one tile for its cooperative
    fingerprint loads. The template sizes its arrays from this, and checks.py rejects a schema
    whose total does not fit, so the two cannot disagree; the template also static_asserts the
    struct sizes against it.
    """
    threads: int
    entry_bytes: int     # sizeof(Entry): the record, slot, prev_pos, and two int flags
    staged_entries: int  # entries per chunk: threads - 32 (warp 0 walks), or 32 for a one-warp block
    slice_chunks: int    # 16-byte chunks per row in one slice of a warp's cooperative fingerprint
    tile_bytes: int      # sizeof(KvWarpTile<slice_chunks>): 32 rows of slice_chunks + 1 (padding) chunks

    buffers = 2  # chunk k walked while chunk k+1 is staged

    @property
    def stager_warps(self) -> int:
        return self.staged_entries // WARP_SIZE

    @property
    def total_bytes(self) -> int:
        return self.buffers * self.staged_entries * self.entry_bytes + self.tile_bytes * self.stager_warps

    @property
    def limit_bytes(self) -> int:
        return STATIC_SHARED_MEMORY_BYTES

    @property
    def fits(self) -> bool:
        return self.total_bytes <= STATIC_SHARED_MEMORY_BYTES


def block_per_request_shared_memory(canary: "Record", threads: int) -> BlockSharedMemory:
    """Two buffers of staged Entries plus one tile per staging warp, with the widest slice that still fits."""
    entry = 8 * (len(canary.fields) + 3)
    staged = threads - WARP_SIZE if threads > WARP_SIZE else WARP_SIZE
    warps = staged // WARP_SIZE
    per_warp_tile = (STATIC_SHARED_MEMORY_BYTES - BlockSharedMemory.buffers * staged * entry) // warps
    chunks = next((k for k in (8, 4, 2) if per_warp_tile >= WARP_SIZE * _KV_CHUNK_BYTES * (k + 1)), 1)
    return BlockSharedMemory(threads, entry, staged, chunks, WARP_SIZE * (chunks + 1) * _KV_CHUNK_BYTES)


def verify_slice_chunks(threads: int) -> int:
    """16-byte chunks per row in one staged slice of the verify kernel's cooperative fingerprint: 8
    (128 bytes, one cache line per row) while the block's warp tiles stay small, fewer for big blocks
    so that static shared memory stays within STATIC_SHARED_MEMORY_BYTES (kv_canary/csrc/kvc_verify.cuh)."""
    return 8 if threads <= 256 else (4 if threads <= 512 else 2)


def max_block_per_request_threads(canary: "Record", cap: int) -> int:
    """The most threads (a multiple of 32, at most cap) whose shared memory fits; 0 if none does."""
    return next((t for t in range(cap - cap % WARP_SIZE, 0, -WARP_SIZE)
                 if block_per_request_shared_memory(canary, t).fits), 0)


@dataclass(frozen=True)
class Constant:
    name: str
    type: str
    value: int
    doc: str
    loc: Loc
    where: Mapping[str, Loc] = _where()

    @property
    def cpp_type(self) -> str:
        return CONSTANT_TYPES[self.type][0]


@dataclass(frozen=True)
class InputVerify:
    expected: str       # one of INPUT_EXPECTED_SOURCES
    fail_reason: str    # a FailReason member
    loc: Loc
    where: Mapping[str, Loc] = _where()


@dataclass(frozen=True)
class Field:
    name: str
    index: int          # word index inside the record
    offset: int         # byte offset inside the record
    role: str           # canary roles; "" for other records
    carries: str        # violation column meaning; "" for other records
    verify: Optional[InputVerify]
    doc: str
    loc: Loc
    where: Mapping[str, Loc] = _where()
    source: str = ""    # role input: one of INPUT_VALUE_SOURCES; "" otherwise


@dataclass(frozen=True)
class Chain:
    anchor: str                 # a u64 constant
    fold: tuple[str, ...]       # field names, in fold order
    loc: Loc
    fold_locs: tuple[Loc, ...] = dc_field(default=(), compare=False, hash=False, repr=False)
    where: Mapping[str, Loc] = _where()


@dataclass(frozen=True)
class Record:
    name: str
    word: str                   # int64 / int32
    word_bytes: int
    fields: tuple[Field, ...]
    stride_bytes: int           # canary: slot stride; others: the packed row size
    chain: Optional[Chain]
    loc: Loc
    where: Mapping[str, Loc] = _where()

    @property
    def record_bytes(self) -> int:
        return len(self.fields) * self.word_bytes

    def field(self, name: str) -> Field:
        for f in self.fields:
            if f.name == name:
                return f
        raise KeyError(name)

    def by_role(self, role: str) -> Field:
        return next(f for f in self.fields if f.role == role)

    def by_carries(self, carries: str) -> Field:
        return next(f for f in self.fields if f.carries == carries)

    @property
    def input_fields(self) -> tuple[Field, ...]:
        return tuple(f for f in self.fields if f.role == ROLE_INPUT)

    def verified_inputs(self, expected: str) -> tuple[Field, ...]:
        """Input fields verified against a per_request value or a per_slot table (docs/semantics.md §8)."""
        return tuple(f for f in self.input_fields if f.verify is not None and f.verify.expected == expected)

    @property
    def per_request_fields(self) -> tuple[Field, ...]:
        return self.verified_inputs("per_request")

    @property
    def per_slot_fields(self) -> tuple[Field, ...]:
        return self.verified_inputs("per_slot")

    @property
    def chain_fields(self) -> tuple[Field, ...]:
        return tuple(self.field(n) for n in self.chain.fold) if self.chain else ()


@dataclass(frozen=True)
class Member:
    name: str
    value: int
    loc: Loc
    kind: str = ""      # FailReason members: one of FAIL_REASON_KINDS
    where: Mapping[str, Loc] = _where()


@dataclass(frozen=True)
class LaunchTag:
    """A CanaryLaunchTag member and where the manager launches it."""
    name: str
    value: int
    phase: str          # one of LAUNCH_PHASES
    half: str           # one of LAUNCH_HALVES
    group: str          # a pool group name (`full`, `swa`, ...)
    loc: Loc
    where: Mapping[str, Loc] = _where()

    @property
    def coordinates(self) -> tuple[str, str, str]:
        return (self.phase, self.half, self.group)


@dataclass(frozen=True)
class ValueSet:
    """A flag set (bit values) or an enum (plain values)."""
    name: str
    kind: str                   # "flag" or "enum"
    members: tuple[Member, ...]
    loc: Loc
    generated_from: str = ""    # "launch_tags" for CanaryLaunchTag; "" for a set the schema declares

    def __getitem__(self, name: str) -> Member:
        for m in self.members:
            if m.name == name:
                return m
        raise KeyError(name)


@dataclass(frozen=True)
class Message:
    key: str
    text: str                   # with {schema.X} already substituted
    placeholders: tuple[str, ...]
    loc: Loc


@dataclass(frozen=True)
class Launch:
    shape: str
    threads: int
    blocks_per_sm: int          # persistent only, else 0
    blocks: int                 # fixed_grid only, else 0
    loc: Loc
    where: Mapping[str, Loc] = _where()


@dataclass(frozen=True)
class Specialization:
    name: str
    values: tuple[bool, ...]
    loc: Loc


@dataclass(frozen=True)
class Kernel:
    name: str
    operation: str    # the operation it runs (codegen/operations.py OPERATIONS), kernels.yaml `operation:`
    launch: Launch
    warp_reduction: bool
    specializations: tuple[Specialization, ...]
    loc: Loc
    where: Mapping[str, Loc] = _where()
    # The kernel's parameters in ABI order (codegen.kernel_abi.Param), attached after the checks.
    params: tuple = dc_field(default=(), compare=False)

    @property
    def variants(self) -> tuple[tuple[str, dict], ...]:
        """Every specialisation as (entry-point symbol, {flag: value}); ordered, deterministic."""
        out: list[tuple[str, dict]] = [(self.name, {})]
        for spec in self.specializations:
            grown = []
            for symbol, flags in out:
                for value in spec.values:
                    suffix = f"_{spec.name}" if value else ""
                    grown.append((symbol + suffix, {**flags, spec.name: value}))
            out = grown
        return tuple(out)


@dataclass(frozen=True)
class Schema:
    format: int
    abi_version: int
    constants: tuple[Constant, ...]
    canary: Record
    violation: Record
    real_kv_source: Record
    flags: tuple[ValueSet, ...]
    enums: tuple[ValueSet, ...]
    message_prefix: str
    messages: tuple[Message, ...]
    kernels: tuple[Kernel, ...]
    launch_tags: tuple[LaunchTag, ...]
    source_name: str
    # Location of each top-level key (`constants:`, `kernels:`, ...): where "missing X" errors point.
    section_locs: Mapping[str, Loc] = _where()
    # `FILE:LINE:COL: note: ...` lines: what the schema states that it need not (codegen/facts.py).
    notes: tuple[str, ...] = dc_field(default=(), compare=False)

    def section_loc(self, key: str) -> Loc:
        return self.section_locs.get(key, Loc(self.source_name, 1, 1))

    def constant(self, name: str) -> Constant:
        for c in self.constants:
            if c.name == name:
                return c
        raise KeyError(name)

    def flag_set(self, name: str) -> ValueSet:
        return next(v for v in self.flags if v.name == name)

    def enum(self, name: str) -> ValueSet:
        return next(v for v in self.enums if v.name == name)

    def message(self, key: str) -> Message:
        return next(m for m in self.messages if m.key == key)

    def kernel(self, name: str) -> Kernel:
        return next(k for k in self.kernels if k.name == name)

    def kernels_by_operation(self, operation: str) -> tuple[Kernel, ...]:
        return tuple(k for k in self.kernels if k.operation == operation)

    @property
    def fail_reason(self) -> ValueSet:
        return self.flag_set("FailReason")

    def fail_reasons_of_kind(self, *kinds: str) -> tuple[Member, ...]:
        return tuple(m for m in self.fail_reason.members if m.kind in kinds)

    @property
    def token_fail_reasons(self) -> tuple[Member, ...]:
        return tuple(m for m in self.fail_reason.members if m.name in TOKEN_FAIL_REASONS)

    @property
    def launch_groups(self) -> tuple[str, ...]:
        """Pool groups in order of first appearance in launch_tags."""
        return tuple(dict.fromkeys(t.group for t in self.launch_tags))

    @property
    def chain_head(self) -> int:
        """HEAD = splitmix64(anchor), docs/semantics.md §2."""
        return splitmix64(self.constant(self.canary.chain.anchor).value)
