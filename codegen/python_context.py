"""Typed render context of templates/python/kernel_abi.py.j2: the kernel ABI as data.

Each kernel parameter becomes one row (name, C type, value source) in the vocabulary of
kv_canary/backends/binder.py, which compiles every kernel's binding from the rows at run time; the
real-KV block is one row (REAL_KV) standing for its MAX_REAL_KV_SOURCES sources and their count.
Rows are built here from the typed sources of codegen/kernel_abi.py (no expression text), the way
codegen/cuda_context.py builds the CUDA templates' contexts.
"""
from __future__ import annotations

from dataclasses import dataclass, fields

from .kernel_abi import (
    ENTRY_POINT_PREFIX,
    REAL_KV_PATH,
    REAL_KV_SOURCE_PARAMS,
    REAL_KV_TAIL_PARAMS,
    Int,
    KvField,
    KvTensor,
    Param,
    Ptr,
    RealKvCount,
    RealKvPart,
    Size,
    Stride,
    entry_points,
)
from .load import layout_fingerprint
from .model import Kernel, Schema
from .operations import (
    OPERATIONS,
    UNKNOWN,
    WRITE_PLAN_FIELDS,
    DataField,
    TensorRule,
    argument_kinds,
    checked_by_validation,
    plan_stage_values,
    verify_plan_fields,
)
from .outputs import kernel_source_template

REAL_KV_ROW = "REAL_KV"  # the name of the real-KV block in the generated module


def _call(name: str, *args, **options) -> str:
    """`Name(arg, ..., option=value)`, the options that differ from their defaults only."""
    parts = [repr(a) for a in args] + [f"{k}={v!r}" for k, v in options.items() if v]
    return f"{name}({', '.join(parts)})"


def source_text(param: Param, kinds: dict[str, str]) -> str:
    """A parameter's value source, as the binder's vocabulary writes it."""
    src = param.source
    if isinstance(src, Ptr):
        return _call("Ptr", src.path, optional=src.optional, when=src.when)
    if isinstance(src, (Size, Stride)):
        return _call(type(src).__name__, src.path, src.dim, optional=src.optional)
    if isinstance(src, Int):
        return _call("Int", src.path, checked=not checked_by_validation(param, kinds))
    raise ValueError(f"kernel parameter {param.name}: no row for source {src!r}")


def _spec_text(spec) -> str:
    if isinstance(spec, KvTensor):
        return _call("KvTensor", spec.what)
    assert isinstance(spec, KvField)
    if spec.default is not None:
        return f"KvField({spec.name!r}, default={spec.default!r})"
    return _call("KvField", spec.name, fallback=spec.fallback)


@dataclass(frozen=True)
class KernelRows:
    kernel: Kernel
    operation: str             # the operation the kernel runs (the schema's kernel key naming it)
    entry_points: tuple[tuple[str, dict], ...]
    params: tuple[str, ...]    # one row per parameter ("(name, C type, source)"), the real-KV block as REAL_KV


@dataclass(frozen=True)
class OperationRows:
    name: str
    device_of: str
    keywords: tuple[str, ...]
    defaults: dict
    rules: tuple[TensorRule, ...]


@dataclass(frozen=True)
class KernelAbiModule:
    """python/kernel_abi.py.j2."""
    schema: Schema
    regenerate: str
    fingerprint: str
    entry_point_prefix: str
    max_real_kv_sources: int
    argument_kinds: dict
    real_kv_path: str
    real_kv_source: tuple[str, ...]         # the rows of one real-KV source
    real_kv_count: tuple[str, str]          # (name, C type) of the block's count
    kernels: tuple[KernelRows, ...]
    unknown: int
    verify_plan_fields: tuple[DataField, ...]
    write_plan_fields: tuple[DataField, ...]
    kernel_operations: tuple[str, ...]
    operations: tuple[OperationRows, ...]
    plan_stages: dict


def kernel_rows(kernel: Kernel, kinds: dict[str, str]) -> KernelRows:
    rows: list[str] = []
    for p in kernel.params:
        if isinstance(p.source, (RealKvPart, RealKvCount)):
            if REAL_KV_ROW not in rows:
                rows.append(REAL_KV_ROW)
        else:
            rows.append(f"({p.name!r}, {p.ctype!r}, {source_text(p, kinds)})")
    return KernelRows(kernel, kernel.operation, entry_points(kernel), tuple(rows))


def kernel_abi_module(schema: Schema, regenerate: str) -> KernelAbiModule:
    kinds = argument_kinds(schema)
    (count_name, count_ctype, _), = (row for row in REAL_KV_TAIL_PARAMS if isinstance(row[2], RealKvCount))
    operations = tuple(OperationRows(name, op.device_of, tuple(k.name for k in op.keywords), op.defaults,
                                     op.tensors(schema)) for name, op in OPERATIONS.items())
    return KernelAbiModule(
        schema, regenerate, layout_fingerprint(schema), ENTRY_POINT_PREFIX,
        schema.constant("MAX_REAL_KV_SOURCES").value, kinds, REAL_KV_PATH,
        tuple(f"({name!r}, {ctype!r}, {_spec_text(spec)})" for name, ctype, spec in REAL_KV_SOURCE_PARAMS),
        (count_name, count_ctype),
        tuple(kernel_rows(k, kinds) for k in schema.kernels if kernel_source_template(k) is not None),
        UNKNOWN, verify_plan_fields(schema), WRITE_PLAN_FIELDS,
        tuple(name for name, op in OPERATIONS.items() if op.kernel), operations, plan_stage_values(schema))


def python_context(template: str, schema: Schema, regenerate: str) -> dict | None:
    """The variables of a Python template with a typed context (None for the others)."""
    if template != "python/kernel_abi.py.j2":
        return None
    ctx = kernel_abi_module(schema, regenerate)
    return {f.name: getattr(ctx, f.name) for f in fields(ctx)}
