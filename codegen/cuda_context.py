"""Typed render contexts of the CUDA, emulation and cpu templates (templates/cuda/, templates/emulation/,
templates/cpu/).

The device code itself is hand-written (kv_canary/csrc/); these templates render only the schema's
constants and tables and the entry points that specialise the headers' functions. Each template
gets one frozen dataclass holding exactly what it renders, built here from the checked model; its
fields become the template's variables (`cuda_context`).
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .kernel_abi import REAL_KV_SOURCE_PARAMS, REAL_KV_TAIL_PARAMS, entry_points
from .load import layout_fingerprint
from .model import (
    STATIC_SHARED_MEMORY_BYTES,
    BlockSharedMemory,
    Field,
    Kernel,
    Record,
    Schema,
    ValueSet,
    block_per_request_shared_memory,
    verify_slice_chunks,
)
from .operations import OPERATIONS, UNKNOWN
from .outputs import kernel_source_template


@dataclass(frozen=True)
class WordTable:
    """Some canary fields as a `kvc::Words<...>` list (and their mismatch reasons as `kvc::Bits<...>`)."""
    fields: tuple[Field, ...]

    @property
    def words(self) -> str:
        return ", ".join(str(f.index) for f in self.fields)

    @property
    def names(self) -> str:
        return ", ".join(f.name for f in self.fields) or "none"

    @property
    def reasons(self) -> str:
        return ", ".join(f"kvc_set_FailReason::kvc_member_{f.verify.fail_reason}" for f in self.fields)


@dataclass(frozen=True)
class LayoutHeader:
    """cuda/kv_canary_layout.cuh.j2: the schema's constants and tables for kv_canary/csrc/."""
    schema: Schema
    fingerprint: str
    chain_head: int
    canary: Record
    violation: Record
    fail_reason: ValueSet
    chain_fold: WordTable
    stored: WordTable       # what write stores: every field but the reserved ones
    inputs: WordTable       # role input, filled from extra_input_<field>
    per_request: WordTable  # inputs verified against a per_request value
    per_slot: WordTable     # inputs verified against a per_slot table
    unknown: int            # codegen.operations.UNKNOWN


@dataclass(frozen=True)
class KernelSource:
    """cuda/<template>.cu.j2: one kernel's entry points over its header in kv_canary/csrc/."""
    kernel: Kernel
    entry_points: tuple[tuple[str, dict], ...]  # (extern "C" symbol, {specialisation: value})
    real_kv_sources: str                        # the kvc::RealKvSources built from the real-KV parameters
    inputs: tuple[Field, ...]
    per_request: tuple[Field, ...]
    per_slot: tuple[Field, ...]


@dataclass(frozen=True)
class VerifySource(KernelSource):
    """cuda/verify.cu.j2."""
    slice_chunks: int         # codegen.model.verify_slice_chunks
    shared_memory_limit: int  # bytes of static shared memory a block may declare


@dataclass(frozen=True)
class WriteBlockSource(KernelSource):
    """cuda/write_block_per_request.cu.j2: the shared memory the schema was checked against."""
    smem: BlockSharedMemory


@dataclass(frozen=True)
class EmulatedKernel:
    kernel: Kernel
    entry_points: tuple[tuple[str, dict], ...]
    entry_order: bool  # the launcher re-stores the rows in entry order (kvc::EntryOrderLog; KernelTemplateSpec.entry_order)


@dataclass(frozen=True)
class Launchers:
    """emulation/launchers.cpp.j2: every generated kernel's host-emulation launchers."""
    kernels: tuple[EmulatedKernel, ...]


@dataclass(frozen=True)
class CpuKernel:
    """One kernel of the cpu library: each entry point's host loop, called through the call macro the
    CUDA entry point uses (cuda/_params.j2 `<operation>_call`)."""
    kernel: Kernel
    entry_points: tuple[tuple[str, str], ...]  # (extern "C" symbol, its kvc_cpu.h function with template arguments)
    call: str                                  # the macro of cuda/_params.j2 that builds the argument structs


@dataclass(frozen=True)
class CpuSource:
    """cpu/kernels.cpp.j2: the entry points of every kernel whose operation has a host loop in
    kv_canary/csrc/kvc_cpu.h (codegen/operations.py KernelTemplateSpec.cpu) as host functions, building
    the argument structs as the CUDA entry points do (cuda/_params.j2's *_call macros)."""
    kernels: tuple[CpuKernel, ...]
    real_kv_sources: str
    inputs: tuple[Field, ...]
    per_request: tuple[Field, ...]
    per_slot: tuple[Field, ...]


def real_kv_sources_init(schema: Schema) -> str:
    """`kvc::RealKvSources{ {ptr_0, ptr_1, ...}, ..., num_sources, hash_mode}` over the kernel parameters."""
    n = schema.constant("MAX_REAL_KV_SOURCES").value
    groups = ["{" + ", ".join(f"{name}_{i}" for i in range(n)) + "}" for name, _, _ in REAL_KV_SOURCE_PARAMS]
    return "kvc::RealKvSources{\n" + ",\n".join(" " * 10 + g for g in groups + [name for name, _, _ in REAL_KV_TAIL_PARAMS]) + "}"


def layout_header(schema: Schema) -> LayoutHeader:
    canary = schema.canary
    return LayoutHeader(
        schema, layout_fingerprint(schema), schema.chain_head, canary, schema.violation, schema.fail_reason,
        WordTable(canary.chain_fields), WordTable(tuple(f for f in canary.fields if f.role != "reserved")),
        WordTable(canary.input_fields), WordTable(canary.per_request_fields), WordTable(canary.per_slot_fields), UNKNOWN)


def kernel_source(schema: Schema, kernel: Kernel) -> KernelSource:
    canary = schema.canary
    base = dict(kernel=kernel, entry_points=entry_points(kernel), real_kv_sources=real_kv_sources_init(schema),
                inputs=canary.input_fields, per_request=canary.per_request_fields, per_slot=canary.per_slot_fields)
    if kernel.operation == "verify":
        return VerifySource(**base, slice_chunks=verify_slice_chunks(kernel.launch.threads),
                            shared_memory_limit=STATIC_SHARED_MEMORY_BYTES)
    if kernel.launch.shape == "block_per_request":
        return WriteBlockSource(**base, smem=block_per_request_shared_memory(canary, kernel.launch.threads))
    return KernelSource(**base)


def launchers(schema: Schema) -> Launchers:
    return Launchers(tuple(EmulatedKernel(k, entry_points(k), OPERATIONS[k.operation].kernel.entry_order)
                           for k in schema.kernels if kernel_source_template(k) is not None))


def cpu_kernel(kernel: Kernel) -> CpuKernel:
    """`kvc_cpu::<operation>`, specialised like the CUDA entry point: one bool template argument per
    specialisation the operation declares, in its order."""
    flags = OPERATIONS[kernel.operation].kernel.specializations
    def function(values: dict) -> str:
        args = ", ".join("true" if values.get(flag, False) else "false" for flag in flags)
        return f"kvc_cpu::{kernel.operation}" + (f"<{args}>" if flags else "")
    return CpuKernel(kernel, tuple((symbol, function(values)) for symbol, values in entry_points(kernel)),
                     f"{kernel.operation}_call")


def cpu_source(schema: Schema) -> CpuSource:
    canary = schema.canary
    kernels = tuple(cpu_kernel(k) for k in schema.kernels
                    if kernel_source_template(k) is not None and OPERATIONS[k.operation].kernel.cpu)
    return CpuSource(kernels, real_kv_sources_init(schema), canary.input_fields,
                     canary.per_request_fields, canary.per_slot_fields)


def typed_context(template: str, schema: Schema, kernel: Kernel | None):
    """The typed context of a CUDA, emulation or cpu template, or None for the other templates (which
    take render.template_context)."""
    if template == "cuda/kv_canary_layout.cuh.j2":
        return layout_header(schema)
    if template == "emulation/launchers.cpp.j2":
        return launchers(schema)
    if template == "cpu/kernels.cpp.j2":
        return cpu_source(schema)
    if template.startswith("cuda/") and kernel is not None:
        return kernel_source(schema, kernel)
    return None


def cuda_context(template: str, schema: Schema, kernel: Kernel | None) -> dict | None:
    """The variables of a CUDA or emulation template: its typed context's fields (None for the others)."""
    ctx = typed_context(template, schema, kernel)
    return None if ctx is None else {f.name: getattr(ctx, f.name) for f in fields(ctx)}
