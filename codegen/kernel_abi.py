"""The kernel ABI as typed data: every kernel parameter's name, C type and where its value comes from.

This is the one description of each kernel's parameters. The CUDA signatures
(templates/cuda/*.cu.j2), the host-emulation and cpu launchers (templates/emulation/launchers.cpp.j2,
templates/cpu/kernels.cpp.j2) and the Python parameter table (templates/python/kernel_abi.py.j2 ->
generated/kernel_abi.py) are all rendered from it, so they cannot disagree; a parameter that is
added here reaches all of them at `make generate`.

A parameter's value comes from a typed value source (below): a path over the arguments of the
backend operation that launches the kernel (its keywords in the operation table,
codegen/operations.py), read as a tensor's data pointer, a size, a stride or an integer, or the
real-KV block of the context's sources. The generated table (generated/kernel_abi.py) lists each
parameter as (name, C type, source), and one hand-written binder (kv_canary/backends/binder.py)
compiles each kernel's binding from it at run time; the C type says how the value crosses into C:
a data pointer (`ptr`, None -> NULL) or an integer of the C type's range (`i64`, `i32`).

The same description says which Python arguments must fit which C integer type
(codegen.operations.argument_kinds): the validators check them, with the argument's own name,
before any launch.
Entry points are extern "C" symbols `ENTRY_POINT_PREFIX + <kernel name>[_<specialisation>]`: the
prefix keeps a schema's kernel names apart from every C library, shim and generated name.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Union

from .model import Kernel, Schema

# C type -> (kind, element type of a pointer or "", the torch dtype a pointer's tensor has)
C_TYPES = {
    "long long": ("i64", ""),
    "int": ("i32", ""),
    "unsigned char*": ("ptr", "uint8"),
    "const unsigned char*": ("ptr", "uint8"),
    "long long*": ("ptr", "int64"),
    "const long long*": ("ptr", "int64"),
    "unsigned long long*": ("ptr", "int64"),
    "int*": ("ptr", "int32"),
    "const int*": ("ptr", "int32"),
}
# Integer ranges of the scalar kinds (what the binding checks before a launch).
KIND_RANGES = {"i64": (-(1 << 63), (1 << 63) - 1), "i32": (-(1 << 31), (1 << 31) - 1)}
# The scalar kind of each pointer element type (the C integer a counter pointer holds).
ELEMENT_KINDS = {"int64": "i64", "int32": "i32"}

# Every extern "C" kernel symbol starts with this. Neither the shim (kvc_emu*, KVC_EMU_*), the
# generated header (kvc, kvc_*, kv_canary_*), libc nor CUDA declare a name with this prefix, so a
# kernel may be called anything the schema's name rules allow; profilers show e.g.
# `kvcanary_canary_verify`.
ENTRY_POINT_PREFIX = "kvcanary_"

# -- value sources: where a parameter's value comes from (kv_canary/backends/binder.py reads the same
# vocabulary in the generated table). A path is `argument[.attribute ...][[key]]` over the operation's
# arguments ("context.canary_buf", "extra_inputs[lang]").
@dataclass(frozen=True)
class Ptr:
    """A tensor's data pointer; `optional`: None (or an attribute the object lacks) passes NULL;
    `when`: the flag argument that enables it (NULL while the flag is false)."""
    path: str
    optional: bool = False
    when: str = ""


@dataclass(frozen=True)
class Size:
    """`shape[dim]` of a tensor (0 for None when `optional`)."""
    path: str
    dim: int
    optional: bool = False


@dataclass(frozen=True)
class Stride:
    """`stride(dim)` of a tensor in elements (0 for None when `optional`)."""
    path: str
    dim: int
    optional: bool = False


@dataclass(frozen=True)
class Int:
    """An integer argument, passed as it is when validation range-checks it (argument_kinds), else
    range-checked by the binding."""
    path: str

    @property
    def argument(self) -> str:
        """The operation argument it is ("" for a value read from an object)."""
        return "" if "." in self.path or "[" in self.path else self.path


@dataclass(frozen=True)
class KvTensor:
    """What a real-KV parameter reads of its source's tensor: "ptr", "row_stride_bytes" or "rows"."""
    what: str


@dataclass(frozen=True)
class KvField:
    """A RealKvSource field; a source object without it passes `default`, or with `fallback` that
    field's value (also when the field is 0 or None)."""
    name: str
    default: Optional[int] = None
    fallback: str = ""


@dataclass(frozen=True)
class RealKvPart:
    """Parameter `spec` of real-KV source `index` (a slot of the real-KV block)."""
    index: int
    spec: Union[KvTensor, KvField]


@dataclass(frozen=True)
class RealKvCount:
    """The number of real-KV sources (the block's last parameter)."""
    path: str


Source = Union[Ptr, Size, Stride, Int, RealKvPart, RealKvCount]

# The context's RealKvSource list: what the real-KV block reads.
REAL_KV_PATH = "context.real_kv_sources"

# The real-KV parameters of one source, in ABI order: (name, C type, what it reads of the RealKvSource);
# MAX_REAL_KV_SOURCES of them, then the count and the context's hash mode.
REAL_KV_SOURCE_PARAMS = (
    ("real_kv_ptr", "const unsigned char*", KvTensor("ptr")),
    ("real_kv_row_stride_bytes", "long long", KvTensor("row_stride_bytes")),
    ("real_kv_num_rows", "long long", KvTensor("rows")),
    ("real_kv_page_size", "int", KvField("page_size")),
    ("real_kv_num_bytes_per_token", "int", KvField("num_bytes_per_token")),
    ("real_kv_read_bytes", "int", KvField("read_bytes")),
    # Where a slot's bytes lie in a row (RealKvSource's layout fields; a source without them, e.g.
    # SGLang's own, has SGLang's packed rows): kvc::RealKvSources, kv_canary/csrc/kvc_device.cuh.
    ("real_kv_token_stride_bytes", "long long", KvField("token_stride_bytes", fallback="num_bytes_per_token")),
    ("real_kv_num_heads", "int", KvField("num_heads", default=1)),
    ("real_kv_head_stride_bytes", "long long", KvField("head_stride_bytes", default=0)),
    ("real_kv_chunk_bytes", "int", KvField("chunk_bytes", default=0)),
    ("real_kv_chunk_stride_bytes", "long long", KvField("chunk_stride_bytes", default=0)),
    ("real_kv_token_group_size", "int", KvField("token_group_size", default=0)),
    ("real_kv_token_group_stride_bytes", "long long", KvField("token_group_stride_bytes", default=0)),
    ("real_kv_chunk_group_size", "int", KvField("chunk_group_size", default=0)),
    ("real_kv_chunk_group_stride_bytes", "long long", KvField("chunk_group_stride_bytes", default=0)),
)
REAL_KV_TAIL_PARAMS = (
    ("real_kv_num_sources", "int", RealKvCount(REAL_KV_PATH)),
    ("real_kv_hash_mode", "int", Int("context.real_kv_hash_mode")),
)


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str
    source: Source      # where its value comes from, over the operation's arguments
    # An `int*` the kernel stores a count into: the Python argument (a capacity) that bounds the
    # count, which therefore must fit the pointer's element type.
    holds_count_of: str = ""

    @property
    def kind(self) -> str:
        return C_TYPES[self.ctype][0]

    @property
    def dtype(self) -> str:
        """torch dtype name of a pointer's tensor ('' for scalars)."""
        return C_TYPES[self.ctype][1]

    @property
    def is_pointer(self) -> bool:
        return self.kind == "ptr"

    @property
    def real_kv(self) -> bool:
        """A parameter of the real-KV block (the sources and their count)."""
        return isinstance(self.source, (RealKvPart, RealKvCount))

    @property
    def real_kv_source(self) -> int:
        """The real-KV source this parameter belongs to (-1 for any other parameter)."""
        return self.source.index if isinstance(self.source, RealKvPart) else -1

    @property
    def restrict(self) -> bool:
        """`__restrict__` in the signature: every pointer but the ones that may alias (the canary
        buffer is read and written through two names in write; real-KV sources may share storage)."""
        return self.is_pointer and self.name != "canary_buf" and not self.name.startswith("real_kv_ptr")


def _p(name: str, ctype: str, source: Source, holds_count_of: str = "") -> Param:
    if ctype not in C_TYPES:
        raise ValueError(f"kernel parameter {name}: unknown C type {ctype!r}")
    if holds_count_of and C_TYPES[ctype][0] != "ptr":
        raise ValueError(f"kernel parameter {name}: only a pointer can hold a count, got {ctype!r}")
    return Param(name, ctype, source, holds_count_of)


def real_kv_params(schema: Schema) -> tuple[Param, ...]:
    """The real-KV parameters: per source (up to MAX_REAL_KV_SOURCES), then count and mode."""
    out = [_p(f"{name}_{i}", ctype, RealKvPart(i, spec))
           for i in range(schema.constant("MAX_REAL_KV_SOURCES").value) for name, ctype, spec in REAL_KV_SOURCE_PARAMS]
    return (*out, *(_p(name, ctype, src) for name, ctype, src in REAL_KV_TAIL_PARAMS))


def _ring_params() -> tuple[Param, ...]:
    return (
        _p("launch_tag", "long long", Int("context.kernel_kind")),
        _p("violation_ring", "long long*", Ptr("context.violation_ring")),
        _p("violation_ring_capacity", "long long", Size("context.violation_ring", 0)),
        _p("violation_write_index", "int*", Ptr("context.violation_write_index"), holds_count_of="ring_capacity"),
        # [extension] per-reason totals; an SGLang-style context without the field passes NULL.
        _p("violation_reason_counts", "unsigned long long*", Ptr("context.violation_reason_counts", optional=True)),
        _p("slot_run_counter", "unsigned long long*", Ptr("context.slot_run_counter")),
        _p("kernel_run_counter", "unsigned long long*", Ptr("context.kernel_run_counter")),
    )


def _buffer_params(const: bool) -> tuple[Param, ...]:
    return (
        _p("canary_buf", "const unsigned char*" if const else "unsigned char*", Ptr("context.canary_buf")),
        _p("num_slots", "long long", Size("context.canary_buf", 0)),
        _p("slot_stride_bytes", "long long", Stride("context.canary_buf", 0)),
    )


def write_params(schema: Schema) -> tuple[Param, ...]:
    fields = schema.canary.input_fields
    flag = "enable_write_input_assert"
    return (
        *_buffer_params(const=False),
        _p("write_offsets", "const long long*", Ptr("plan.write_offsets")),
        _p("write_seed_slot_indices", "const long long*", Ptr("plan.write_seed_slot_indices")),
        _p("write_num_valid_reqs", "const int*", Ptr("plan.write_num_valid_reqs")),
        _p("write_req_capacity", "long long", Size("plan.write_seed_slot_indices", 0)),
        _p("input_ids", "const long long*", Ptr("input_ids")),
        _p("positions", "const long long*", Ptr("positions")),
        _p("out_cache_loc", "const long long*", Ptr("out_cache_loc")),
        _p("num_tokens", "long long", Size("input_ids", 0)),
        _p(flag, "int", Int(flag)),
        _p("expected_input_tokens", "const long long*", Ptr("expected_input_tokens", optional=True, when=flag)),
        _p("expected_input_positions", "const long long*", Ptr("expected_input_positions", optional=True, when=flag)),
        *(_p(f"extra_input_{f.name}", "const long long*", Ptr(f"extra_inputs[{f.name}]")) for f in fields),
        _p("enable_chain_position_assert", "const int*", Ptr("context.enable_chain_position_assert")),
        *real_kv_params(schema),
        *_ring_params(),
    )


def verify_params(schema: Schema) -> tuple[Param, ...]:
    return (
        *_buffer_params(const=True),
        _p("verify_slot_indices", "const long long*", Ptr("plan.verify_slot_indices")),
        _p("verify_expected_tokens", "const long long*", Ptr("plan.verify_expected_tokens")),
        _p("verify_expected_positions", "const long long*", Ptr("plan.verify_expected_positions")),
        _p("verify_prev_slot_indices", "const long long*", Ptr("plan.verify_prev_slot_indices")),
        *(_p(f"verify_expected_{f.name}", "const long long*", Ptr(f"plan.verify_expected_{f.name}"))
          for f in schema.canary.per_request_fields),
        _p("verify_num_valid", "const int*", Ptr("plan.verify_num_valid")),
        _p("verify_enable", "const int*", Ptr("plan.enable")),
        _p("verify_capacity", "long long", Size("plan.verify_slot_indices", 0)),
        *(_p(f"slot_table_{f.name}", "const long long*", Ptr(f"extra_slot_tables[{f.name}]"))
          for f in schema.canary.per_slot_fields),
        *real_kv_params(schema),
        *_ring_params(),
    )


def _plan_common() -> tuple[Param, ...]:
    lut = "full_to_swa_index_mapping"
    return (
        _p("req_pool_indices", "const long long*", Ptr("req_pool_indices")),
        _p("prefix_lens", "const long long*", Ptr("prefix_lens")),
        _p("batch_size", "long long", Size("req_pool_indices", 0)),
        _p("req_to_token", "const int*", Ptr("req_to_token")),
        _p("req_to_token_rows", "long long", Size("req_to_token", 0)),
        _p("req_to_token_cols", "long long", Size("req_to_token", 1)),
        _p("req_to_token_row_stride", "long long", Stride("req_to_token", 0)),
        _p("swa_window_size", "long long", Int("swa_window_size")),
        _p(lut, "const long long*", Ptr(lut, optional=True)),
        _p("swa_lut_len", "long long", Size(lut, 0, optional=True)),
    )


def plan_offsets_params(schema: Schema) -> tuple[Param, ...]:
    return (
        *_plan_common(),
        _p("extend_seq_lens", "const long long*", Ptr("extend_seq_lens")),
        _p("verify_capacity", "long long", Int("verify_capacity")),
        _p("verify_offsets", "long long*", Ptr("out_verify_offsets_scratch")),
        _p("write_offsets", "long long*", Ptr("out_write_offsets")),
        _p("write_seed_slot_indices", "long long*", Ptr("out_write_seed_slot_indices")),
        _p("write_num_valid_reqs", "int*", Ptr("out_write_num_valid_reqs"), holds_count_of="write_req_capacity"),
        _p("write_req_capacity", "long long", Size("out_write_seed_slot_indices", 0)),
        _p("verify_num_valid", "int*", Ptr("out_verify_num_valid"), holds_count_of="verify_capacity"),
        _p("verify_enable", "int*", Ptr("out_verify_enable")),
    )


def plan_entries_params(schema: Schema) -> tuple[Param, ...]:
    pool = "req_to_verify_expected_tokens"
    out = [
        *_plan_common(),
        _p("verify_offsets", "const long long*", Ptr("verify_offsets_scratch")),
        _p("verify_enable", "const int*", Ptr("verify_enable")),
        _p("verify_capacity", "long long", Size("out_verify_slot_indices", 0)),
        _p(pool, "const int*", Ptr(pool, optional=True)),
        _p("expected_tokens_rows", "long long", Size(pool, 0, optional=True)),
        _p("expected_tokens_cols", "long long", Size(pool, 1, optional=True)),
        _p("expected_tokens_row_stride", "long long", Stride(pool, 0, optional=True)),
        _p("req_to_verify_expected_tokens_valid_lens", "const long long*",
           Ptr("req_to_verify_expected_tokens_valid_lens", optional=True)),
        _p("kv_token_id_vs_position_offset", "long long", Int("kv_token_id_vs_position_offset")),
        _p("verify_slot_indices", "long long*", Ptr("out_verify_slot_indices")),
        _p("verify_expected_tokens", "long long*", Ptr("out_verify_expected_tokens")),
        _p("verify_expected_positions", "long long*", Ptr("out_verify_expected_positions")),
        _p("verify_prev_slot_indices", "long long*", Ptr("out_verify_prev_slot_indices")),
    ]
    for f in schema.canary.per_request_fields:
        out.append(_p(f"request_value_{f.name}", "const long long*", Ptr(f"extra_request_values[{f.name}]")))
        out.append(_p(f"verify_expected_{f.name}", "long long*", Ptr(f"out_extra_verify_expected[{f.name}]")))
    return tuple(out)


def scatter_params(schema: Schema) -> tuple[Param, ...]:
    return (
        _p("flat_in", "const long long*", Ptr("flat_in")),
        _p("flat_len", "long long", Size("flat_in", 0)),
        _p("offsets", "const long long*", Ptr("offsets")),
        _p("req_pool_indices", "const long long*", Ptr("req_pool_indices")),
        _p("batch_size", "long long", Size("req_pool_indices", 0)),
        _p("pool_out", "int*", Ptr("pool_out")),
        _p("pool_rows", "long long", Size("pool_out", 0)),
        _p("pool_cols", "long long", Size("pool_out", 1)),
        _p("pool_row_stride", "long long", Stride("pool_out", 0)),
    )


def entry_points(kernel: Kernel) -> tuple[tuple[str, dict], ...]:
    """(extern "C" symbol, {flag: value}) of every specialisation of a kernel, in variant order."""
    return tuple((ENTRY_POINT_PREFIX + symbol, flags) for symbol, flags in kernel.variants)


def duplicate_params(params: tuple[Param, ...]) -> list[str]:
    seen, dups = set(), []
    for p in params:
        if p.name in seen:
            dups.append(p.name)
        seen.add(p.name)
    return dups
