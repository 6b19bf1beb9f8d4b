"""The kernel ABI as typed data: every kernel parameter's name, C type and where its value comes from.

This is the one description of each kernel's parameters. The CUDA signatures
(templates/cuda/*.cu.j2), the host-emulation launchers (templates/emulation/launchers.cpp.j2) and
the Python argument binding (templates/python/kernel_abi.py.j2 -> generated/kernel_abi.py) are all
rendered from it, so they cannot disagree; a parameter that is added here reaches all three at
`make generate`.

A parameter's value is a Python expression over the arguments of the backend operation that
launches the kernel (its keywords in the operation table, codegen/operations.py) plus `kv`, the
real-KV parameter tuple of the context (generated `real_kv_args(context)`). `kind` says how the
value crosses into C: a tensor's data pointer (`ptr`, None -> NULL) or an integer checked against the C type's range (`i64`, `i32`).

The same description says which Python arguments must fit which C integer type
(codegen.operations.argument_kinds): the validators check them, with the argument's own name,
before any launch.
Entry points are extern "C" symbols `ENTRY_POINT_PREFIX + <kernel name>[_<specialisation>]`: the
prefix keeps a schema's kernel names apart from every C library, shim and generated name.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

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

# The real-KV parameters of one source, in ABI order: (name, C type, value from the RealKvSource
# `s` and its tensor `t`); generated real_kv_args(context) evaluates them, count and mode follow.
REAL_KV_SOURCE_PARAMS = (
    ("real_kv_ptr", "const unsigned char*", "t.data_ptr()"),
    ("real_kv_row_stride_bytes", "long long", "t.stride(0) * t.element_size()"),
    ("real_kv_num_rows", "long long", "t.shape[0]"),
    ("real_kv_page_size", "int", "s.page_size"),
    ("real_kv_num_bytes_per_token", "int", "s.num_bytes_per_token"),
    ("real_kv_read_bytes", "int", "s.read_bytes"),
    # Where a slot's bytes lie in a row (RealKvSource's layout fields; a source without them, e.g.
    # SGLang's own, has SGLang's packed rows): kvc::RealKvSources, kv_canary/csrc/kvc_device.cuh.
    ("real_kv_token_stride_bytes", "long long", "getattr(s, 'token_stride_bytes', None) or s.num_bytes_per_token"),
    ("real_kv_num_heads", "int", "getattr(s, 'num_heads', 1)"),
    ("real_kv_head_stride_bytes", "long long", "getattr(s, 'head_stride_bytes', 0)"),
    ("real_kv_chunk_bytes", "int", "getattr(s, 'chunk_bytes', 0)"),
    ("real_kv_chunk_stride_bytes", "long long", "getattr(s, 'chunk_stride_bytes', 0)"),
    ("real_kv_token_group_size", "int", "getattr(s, 'token_group_size', 0)"),
    ("real_kv_token_group_stride_bytes", "long long", "getattr(s, 'token_group_stride_bytes', 0)"),
    ("real_kv_chunk_group_size", "int", "getattr(s, 'chunk_group_size', 0)"),
    ("real_kv_chunk_group_stride_bytes", "long long", "getattr(s, 'chunk_group_stride_bytes', 0)"),
)


def source_field(value: str) -> str | None:
    """The RealKvSource field a real-KV parameter's value reads (`s.page_size`,
    `getattr(s, 'num_heads', 1)`), or None for a value of its tensor."""
    m = re.match(r"s\.(\w+)$|getattr\(s, '(\w+)'", value)
    return None if m is None else m.group(1) or m.group(2)
REAL_KV_TAIL_PARAMS = (
    ("real_kv_num_sources", "int", "len(context.real_kv_sources)"),
    ("real_kv_hash_mode", "int", "context.real_kv_hash_mode"),
)


@dataclass(frozen=True)
class Param:
    name: str
    ctype: str
    value: str          # Python expression over the operation's binding_args (codegen/operations.py)
    address: bool = False  # a pointer whose value is already an integer address (the real-KV bytes)
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
    def restrict(self) -> bool:
        """`__restrict__` in the signature: every pointer but the ones that may alias (the canary
        buffer is read and written through two names in write; real-KV sources may share storage)."""
        return self.is_pointer and self.name != "canary_buf" and not self.name.startswith("real_kv_ptr")


def _p(name: str, ctype: str, value: str, address: bool = False, holds_count_of: str = "") -> Param:
    if ctype not in C_TYPES:
        raise ValueError(f"kernel parameter {name}: unknown C type {ctype!r}")
    if holds_count_of and C_TYPES[ctype][0] != "ptr":
        raise ValueError(f"kernel parameter {name}: only a pointer can hold a count, got {ctype!r}")
    return Param(name, ctype, value, address, holds_count_of)


def real_kv_params(schema: Schema) -> tuple[Param, ...]:
    """The real-KV parameters: per source (up to MAX_REAL_KV_SOURCES), then count and mode; their
    values are the context's `kv` tuple (generated real_kv_args), in this order."""
    out = []
    for i in range(schema.constant("MAX_REAL_KV_SOURCES").value):
        for name, ctype, _ in REAL_KV_SOURCE_PARAMS:
            out.append(_p(f"{name}_{i}", ctype, f"kv[{len(out)}]", address=ctype.endswith("*")))
    for name, ctype, _ in REAL_KV_TAIL_PARAMS:
        out.append(_p(name, ctype, f"kv[{len(out)}]"))
    return tuple(out)


def _ring_params() -> tuple[Param, ...]:
    return (
        _p("launch_tag", "long long", "context.kernel_kind"),
        _p("violation_ring", "long long*", "context.violation_ring"),
        _p("violation_ring_capacity", "long long", "context.violation_ring.shape[0]"),
        _p("violation_write_index", "int*", "context.violation_write_index", holds_count_of="ring_capacity"),
        # [extension] per-reason totals; an SGLang-style context without the field passes NULL.
        _p("violation_reason_counts", "unsigned long long*", "getattr(context, 'violation_reason_counts', None)"),
        _p("slot_run_counter", "unsigned long long*", "context.slot_run_counter"),
        _p("kernel_run_counter", "unsigned long long*", "context.kernel_run_counter"),
    )


def _buffer_params(const: bool) -> tuple[Param, ...]:
    return (
        _p("canary_buf", "const unsigned char*" if const else "unsigned char*", "context.canary_buf"),
        _p("num_slots", "long long", "context.canary_buf.shape[0]"),
        _p("slot_stride_bytes", "long long", "context.canary_buf.stride(0)"),
    )


def write_params(schema: Schema) -> tuple[Param, ...]:
    fields = schema.canary.input_fields
    return (
        *_buffer_params(const=False),
        _p("write_offsets", "const long long*", "plan.write_offsets"),
        _p("write_seed_slot_indices", "const long long*", "plan.write_seed_slot_indices"),
        _p("write_num_valid_reqs", "const int*", "plan.write_num_valid_reqs"),
        _p("write_req_capacity", "long long", "plan.write_seed_slot_indices.shape[0]"),
        _p("input_ids", "const long long*", "input_ids"),
        _p("positions", "const long long*", "positions"),
        _p("out_cache_loc", "const long long*", "out_cache_loc"),
        _p("num_tokens", "long long", "input_ids.shape[0]"),
        _p("enable_write_input_assert", "int", "enable_write_input_assert"),
        _p("expected_input_tokens", "const long long*",
           "expected_input_tokens if enable_write_input_assert else None"),
        _p("expected_input_positions", "const long long*",
           "expected_input_positions if enable_write_input_assert else None"),
        *(_p(f"extra_input_{f.name}", "const long long*", f"extra_inputs[{f.name!r}]") for f in fields),
        _p("enable_chain_position_assert", "const int*", "context.enable_chain_position_assert"),
        *real_kv_params(schema),
        *_ring_params(),
    )


def verify_params(schema: Schema) -> tuple[Param, ...]:
    return (
        *_buffer_params(const=True),
        _p("verify_slot_indices", "const long long*", "plan.verify_slot_indices"),
        _p("verify_expected_tokens", "const long long*", "plan.verify_expected_tokens"),
        _p("verify_expected_positions", "const long long*", "plan.verify_expected_positions"),
        _p("verify_prev_slot_indices", "const long long*", "plan.verify_prev_slot_indices"),
        *(_p(f"verify_expected_{f.name}", "const long long*", f"plan.verify_expected_{f.name}")
          for f in schema.canary.per_request_fields),
        _p("verify_num_valid", "const int*", "plan.verify_num_valid"),
        _p("verify_enable", "const int*", "plan.enable"),
        _p("verify_capacity", "long long", "plan.verify_slot_indices.shape[0]"),
        *(_p(f"slot_table_{f.name}", "const long long*", f"extra_slot_tables[{f.name!r}]")
          for f in schema.canary.per_slot_fields),
        *real_kv_params(schema),
        *_ring_params(),
    )


def _plan_common() -> tuple[Param, ...]:
    lut = "full_to_swa_index_mapping"
    return (
        _p("req_pool_indices", "const long long*", "req_pool_indices"),
        _p("prefix_lens", "const long long*", "prefix_lens"),
        _p("batch_size", "long long", "req_pool_indices.shape[0]"),
        _p("req_to_token", "const int*", "req_to_token"),
        _p("req_to_token_rows", "long long", "req_to_token.shape[0]"),
        _p("req_to_token_cols", "long long", "req_to_token.shape[1]"),
        _p("req_to_token_row_stride", "long long", "req_to_token.stride(0)"),
        _p("swa_window_size", "long long", "swa_window_size"),
        _p(lut, "const long long*", lut),
        _p("swa_lut_len", "long long", f"{lut}.shape[0] if {lut} is not None else 0"),
    )


def plan_offsets_params(schema: Schema) -> tuple[Param, ...]:
    return (
        *_plan_common(),
        _p("extend_seq_lens", "const long long*", "extend_seq_lens"),
        _p("verify_capacity", "long long", "verify_capacity"),
        _p("verify_offsets", "long long*", "out_verify_offsets_scratch"),
        _p("write_offsets", "long long*", "out_write_offsets"),
        _p("write_seed_slot_indices", "long long*", "out_write_seed_slot_indices"),
        _p("write_num_valid_reqs", "int*", "out_write_num_valid_reqs", holds_count_of="write_req_capacity"),
        _p("write_req_capacity", "long long", "out_write_seed_slot_indices.shape[0]"),
        _p("verify_num_valid", "int*", "out_verify_num_valid", holds_count_of="verify_capacity"),
        _p("verify_enable", "int*", "out_verify_enable"),
    )


def plan_entries_params(schema: Schema) -> tuple[Param, ...]:
    pool = "req_to_verify_expected_tokens"
    out = [
        *_plan_common(),
        _p("verify_offsets", "const long long*", "verify_offsets_scratch"),
        _p("verify_enable", "const int*", "verify_enable"),
        _p("verify_capacity", "long long", "out_verify_slot_indices.shape[0]"),
        _p(pool, "const int*", pool),
        _p("expected_tokens_rows", "long long", f"{pool}.shape[0] if {pool} is not None else 0"),
        _p("expected_tokens_cols", "long long", f"{pool}.shape[1] if {pool} is not None else 0"),
        _p("expected_tokens_row_stride", "long long", f"{pool}.stride(0) if {pool} is not None else 0"),
        _p("req_to_verify_expected_tokens_valid_lens", "const long long*", "req_to_verify_expected_tokens_valid_lens"),
        _p("kv_token_id_vs_position_offset", "long long", "kv_token_id_vs_position_offset"),
        _p("verify_slot_indices", "long long*", "out_verify_slot_indices"),
        _p("verify_expected_tokens", "long long*", "out_verify_expected_tokens"),
        _p("verify_expected_positions", "long long*", "out_verify_expected_positions"),
        _p("verify_prev_slot_indices", "long long*", "out_verify_prev_slot_indices"),
    ]
    for f in schema.canary.per_request_fields:
        out.append(_p(f"request_value_{f.name}", "const long long*", f"extra_request_values[{f.name!r}]"))
        out.append(_p(f"verify_expected_{f.name}", "long long*", f"out_extra_verify_expected[{f.name!r}]"))
    return tuple(out)


def scatter_params(schema: Schema) -> tuple[Param, ...]:
    return (
        _p("flat_in", "const long long*", "flat_in"),
        _p("flat_len", "long long", "flat_in.shape[0]"),
        _p("offsets", "const long long*", "offsets"),
        _p("req_pool_indices", "const long long*", "req_pool_indices"),
        _p("batch_size", "long long", "req_pool_indices.shape[0]"),
        _p("pool_out", "int*", "pool_out"),
        _p("pool_rows", "long long", "pool_out.shape[0]"),
        _p("pool_cols", "long long", "pool_out.shape[1]"),
        _p("pool_row_stride", "long long", "pool_out.stride(0)"),
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
