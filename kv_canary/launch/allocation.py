"""Launch data classes (SGLang's names and keywords) and the allocators of every canary buffer, for
one generated tree.

Sizes and names come from the tree's layout tables: the record stride, the violation row width,
the enums, and the plan arrays (one `verify_expected_<field>` array per input field a schema
verifies per request). The classes are defined here, once: `RealKvSourceBase`,
`VerifyOrWriteContextBase` and the plans' methods (`VerifyPlanMethods`, `WritePlanMethods`);
`tree_classes(layout, validators)` derives one class of each per tree (holding that tree's
validators and defaults, so two schemas' classes never mix): the tree's Validators make them and
hold them (`Validators.classes`: what they hold was checked when built). `allocators_for(layout,
validators)` returns the tree's namespace of those classes and its allocators.
"""
from __future__ import annotations

import dataclasses
import math
from types import SimpleNamespace
from typing import Any, Callable, ClassVar, NamedTuple, Optional

import torch

_DTYPES = {"int64": torch.int64, "int32": torch.int32}
# What a tree's allocators namespace exports (= codegen ALLOCATOR_NAMES).
NAMES = ("RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "allocate_canary_buf", "canary_buf_bytes",
         "allocate_violation_ring", "violation_ring_bytes", "allocate_reason_counts", "allocate_counter",
         "allocate_counters", "allocate_chain_position_flag", "allocate_context")


def allocate_or_explain(v, what: str, nbytes: int, device: torch.device, make: Callable):
    """`make()`, or a ValueError naming what was asked for where the device cannot satisfy it."""
    try:
        return make()
    except (RuntimeError, MemoryError) as exc:  # torch.OutOfMemoryError is a RuntimeError
        reason = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"{v.prefix}cannot allocate {what} ({nbytes} bytes) on {device}: {reason}") from None


# The plan classes' tensor fields, (name, dtype, dims over the capacity "cap", fill), from the
# tree's kernel ABI (rendered from the operation table, codegen/operations.py).
def _sized(dims: tuple, cap: int) -> tuple:
    return tuple(cap if d == "cap" else cap + 1 if d == "cap+1" else d for d in dims)


def _allocate_fields(fields: tuple, cap: int, device) -> dict:
    return {name: torch.full(_sized(dims, cap), fill, dtype=_DTYPES[dtype], device=device)
            for name, dtype, dims, fill in fields}


def _fields_bytes(fields: tuple, cap: int) -> int:
    return sum(math.prod(_sized(dims, cap)) * _DTYPES[dtype].itemsize for _, dtype, dims, _ in fields)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class RealKvSourceBase:
    """Real K/V bytes folded into the fingerprint (docs/semantics.md §4); validated on construction.

    The first four fields are SGLang's (slots packed one after the other in a row of `tensor`).
    The others say where a slot's bytes lie when they are not packed (vLLM, FlashAttention,
    FlashInfer layouts), read in place: slot s's head h, chunk c starts at byte
    `(s // page_size) * row stride + token(s % page_size) + h * head_stride_bytes
    + c * chunk_stride_bytes` of the tensor, token(t) being `t * token_stride_bytes`, or with token
    groups `(t // token_group_size) * token_group_stride_bytes + (t % token_group_size) * token_stride_bytes`,
    and chunks in groups the same way (`chunk_group_size`, `chunk_group_stride_bytes`). The fingerprint folds a slot's logical bytes (head
    0's, then head 1's, ...), so it does not depend on the layout; the defaults are SGLang's."""
    validators: ClassVar[Any] = None          # the tree's (its class, allocators_for)
    tensor: torch.Tensor
    page_size: int
    num_bytes_per_token: int                  # a slot's bytes over all heads
    read_bytes: int
    token_stride_bytes: Optional[int] = None  # bytes between consecutive slots of a row (None: num_bytes_per_token)
    num_heads: int = 1                        # each head holds num_bytes_per_token / num_heads bytes
    head_stride_bytes: int = 0                # bytes between consecutive heads (> 0 when num_heads > 1)
    chunk_bytes: int = 0                      # 0: a head's bytes contiguous; else 2, 4, 8 or a multiple of 16
    chunk_stride_bytes: int = 0               # bytes between consecutive chunks of a head
    token_group_size: int = 0                 # 0: no token groups; else the tokens of one group of a row
    token_group_stride_bytes: int = 0         # bytes between consecutive token groups of a row
    chunk_group_size: int = 0                 # 0: no chunk groups; else the chunks of one group of a head
    chunk_group_stride_bytes: int = 0         # bytes between consecutive chunk groups of a head

    def __post_init__(self) -> None:
        v = self.validators
        v.check_real_kv_params(page_size=self.page_size, num_bytes_per_token=self.num_bytes_per_token,
                               read_bytes=self.read_bytes)
        if self.token_stride_bytes is None:
            object.__setattr__(self, "token_stride_bytes", self.num_bytes_per_token)
        layout = v.check_real_kv_layout(self, self.num_bytes_per_token)
        for name, value in zip(v.REAL_KV_LAYOUT_FIELDS, layout):  # numpy integers become ints
            object.__setattr__(self, name, value)
        v.check_real_kv_tensor(self.tensor, page_size=self.page_size, num_bytes_per_token=self.num_bytes_per_token,
                               layout=layout)


@dataclasses.dataclass(frozen=True, slots=True, kw_only=True)
class VerifyOrWriteContextBase:
    """What one verify or write launch works on (docs/semantics.md §3); the ring is shared by every launch."""
    validators: ClassVar[Any] = None            # the tree's (its class, allocators_for)
    canary_buf: torch.Tensor                    # uint8 [num_slots, stride]
    kernel_kind: Any                            # the tree's CanaryLaunchTag: stamped into every violation row
    violation_ring: torch.Tensor                # int64 [ring_capacity, VIOLATION_FIELDS]
    violation_write_index: torch.Tensor         # int32 [1]
    slot_run_counter: torch.Tensor              # int64 [1]
    kernel_run_counter: torch.Tensor            # int64 [1]
    real_kv_sources: tuple = ()                 # tuple[RealKvSource, ...], at most MAX_REAL_KV_SOURCES
    real_kv_hash_mode: Any = None               # the tree's RealKvHashMode (its class: default NONE)
    enable_chain_position_assert: torch.Tensor  # int32 [1]: the write's chain-position assert (0 = off)
    # [extension] int64 [VIOLATION_REASON_COUNT_COLUMNS]: +1 per FailReason bit of every row a launch
    # produces, dropped rows included (None = not counted). Share it like the ring.
    violation_reason_counts: Optional[torch.Tensor] = None

    def __post_init__(self) -> None:
        # Frozen: what it holds besides tensors is checked once, here; tensors at every launch.
        self.validators.check_context_fields(self)
        self.validators.check_context_disjoint(self)


class VerifyPlanMethods:
    """What every tree's VerifyPlan has besides its fields (docs/semantics.md §5.2)."""
    __slots__ = ()
    validators: ClassVar[Any] = None

    @classmethod
    def allocate(cls, *, verify_capacity: int, device):
        """Zeroed entries, expected values unknown (UNKNOWN = -1), num_valid 0 and enable 1 (SGLang's default)."""
        v = cls.validators
        cap = v.check_capacity("verify_capacity", verify_capacity, "verify_capacity")
        device = v.check_device("device", device)
        return allocate_or_explain(v, f"a VerifyPlan of verify_capacity={cap}", cls.allocation_bytes(cap), device,
                                   lambda: cls(**_allocate_fields(v.abi.VERIFY_PLAN_FIELDS, cap, device)))

    @classmethod
    def allocation_bytes(cls, verify_capacity: int) -> int:
        """Bytes allocate() takes for this capacity (SGLang's formula; 0 counts the two scalars alone)."""
        v = cls.validators
        return _fields_bytes(v.abi.VERIFY_PLAN_FIELDS, v.check_int("verify_capacity", verify_capacity, minimum=0))

    def zero_for_testing_(self):
        """SGLang's test reset, in place: entries, num_valid and enable 0, expected values unknown (as
        SGLang's verify contract wants); returns the plan. Only for plan tests: a zeroed plan hides
        verify and write bugs."""
        abi = self.validators.abi
        for name, _, _, fill in abi.VERIFY_PLAN_FIELDS:
            getattr(self, name).fill_(fill if fill == abi.UNKNOWN else 0)
        return self


class WritePlanMethods:
    """What every tree's WritePlan has besides its fields (docs/semantics.md §5.1)."""
    __slots__ = ()
    validators: ClassVar[Any] = None

    @classmethod
    def allocate(cls, *, write_req_capacity: int, device):
        """Zeroed offsets and count, seeds unknown (UNKNOWN = -1: the chain head)."""
        v = cls.validators
        cap = v.check_capacity("write_req_capacity", write_req_capacity, "write_capacity")
        device = v.check_device("device", device)
        return allocate_or_explain(v, f"a WritePlan of write_req_capacity={cap}", cls.allocation_bytes(cap), device,
                                   lambda: cls(**_allocate_fields(v.abi.WRITE_PLAN_FIELDS, cap, device)))

    @classmethod
    def allocation_bytes(cls, write_req_capacity: int) -> int:
        """Bytes allocate() takes for this capacity (SGLang's formula; 0 counts one offset and the scalar)."""
        v = cls.validators
        return _fields_bytes(v.abi.WRITE_PLAN_FIELDS, v.check_int("write_req_capacity", write_req_capacity, minimum=0))

    def zero_for_testing_(self):
        """SGLang's test reset, in place: every array 0; returns the plan. Only for plan tests: a
        zeroed plan hides write bugs (seed 0 is a real slot, not the chain head)."""
        for name, *_ in self.validators.abi.WRITE_PLAN_FIELDS:
            getattr(self, name).zero_()
        return self


def _tree_class(name: str, base: type, v, fields: list, namespace: dict) -> type:
    """`base` for one tree: its validators, its own fields (or defaults), named as SGLang names it."""
    return dataclasses.make_dataclass(name, fields, bases=(base,),
                                      namespace={"validators": v, "__module__": __name__, **namespace},
                                      frozen=True, slots=True, kw_only=True)


class TreeClasses(NamedTuple):
    """One tree's launch data classes (tree_classes)."""
    source: type          # RealKvSource
    context: type         # VerifyOrWriteContext
    verify_plan: type     # VerifyPlan
    write_plan: type      # WritePlan


def tree_classes(layout, validators) -> TreeClasses:
    """RealKvSource, VerifyOrWriteContext, VerifyPlan and WritePlan of a tree, checking themselves
    with its `validators` when built."""
    v, abi = validators, validators.abi
    return TreeClasses(
        source=_tree_class("RealKvSource", RealKvSourceBase, v, [], {"__doc__": RealKvSourceBase.__doc__}),
        context=_tree_class(
            "VerifyOrWriteContext", VerifyOrWriteContextBase, v,
            [("kernel_kind", layout.CanaryLaunchTag), ("real_kv_hash_mode", layout.RealKvHashMode,
                                                       dataclasses.field(default=layout.RealKvHashMode.NONE))],
            {"__doc__": VerifyOrWriteContextBase.__doc__}),
        verify_plan=_tree_class(
            "VerifyPlan", VerifyPlanMethods, v, [(name, torch.Tensor) for name, *_ in abi.VERIFY_PLAN_FIELDS],
            {"__doc__": "Flat verify entries (docs/semantics.md §5.2), sized to a fixed capacity.",
             "ARRAY_FIELDS": tuple(name for name, _, dims, _ in abi.VERIFY_PLAN_FIELDS if dims == ("cap",))}),
        write_plan=_tree_class(
            "WritePlan", WritePlanMethods, v, [(name, torch.Tensor) for name, *_ in abi.WRITE_PLAN_FIELDS],
            {"__doc__": "Per-request write ranges and chain seeds (docs/semantics.md §5.1)."}))


def allocators_for(layout, validators) -> SimpleNamespace:
    """The tree's classes (its validators' `classes`) and its allocate_* functions.

    Sizes are validated before anything is allocated (a capacity must fit the C int the kernels
    count it in, a buffer's byte size the kernels' 64-bit offsets), and an allocation the device
    cannot satisfy is a ValueError naming what was asked for, not an allocator traceback.
    """
    v, abi = validators, validators.abi
    RealKvSource, VerifyOrWriteContext, VerifyPlan, WritePlan = validators.classes

    def allocate_canary_buf(num_slots: int, *, device,
                            slot_stride_bytes: int = layout.CANARY_SLOT_STRIDE_BYTES) -> torch.Tensor:
        """Zeroed uint8 [num_slots, slot_stride_bytes]; the stride must hold the record (multiple of 8)."""
        num_slots, slot_stride_bytes = canary_buf_shape(num_slots, slot_stride_bytes)
        device = v.check_device("device", device)
        return allocate_or_explain(
            v, f"canary_buf of {num_slots} slots", num_slots * slot_stride_bytes, device,
            lambda: torch.zeros((num_slots, slot_stride_bytes), dtype=torch.uint8, device=device))

    def canary_buf_shape(num_slots: int, slot_stride_bytes: int) -> tuple[int, int]:
        """(num_slots, slot_stride_bytes) checked as allocate_canary_buf and canary_buf_bytes take them."""
        num_slots = v.check_int("num_slots", num_slots, minimum=0)
        slot_stride_bytes = v.check_int("slot_stride_bytes", slot_stride_bytes, minimum=1)
        v.check_slot_stride(slot_stride_bytes, (num_slots, slot_stride_bytes))
        v.check_extent("canary_buf", num_slots, "num_slots", slot_stride_bytes, "slot_stride_bytes")
        return num_slots, slot_stride_bytes

    def canary_buf_bytes(num_slots: int, slot_stride_bytes: int = layout.CANARY_SLOT_STRIDE_BYTES) -> int:
        """Bytes allocate_canary_buf takes for these sizes (checked as it checks them)."""
        num_slots, slot_stride_bytes = canary_buf_shape(num_slots, slot_stride_bytes)
        return num_slots * slot_stride_bytes

    def allocate_violation_ring(ring_capacity: int, *, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(ring int64 [ring_capacity, VIOLATION_FIELDS] zeroed, write index int32 [1] = 0)."""
        ring_capacity = v.check_ring_capacity(ring_capacity)
        device = v.check_device("device", device)
        return allocate_or_explain(
            v, f"a violation ring of ring_capacity={ring_capacity}", violation_ring_bytes(ring_capacity), device,
            lambda: (torch.zeros((ring_capacity, layout.VIOLATION_FIELDS), dtype=torch.int64, device=device),
                     torch.zeros(1, dtype=torch.int32, device=device)))

    def violation_ring_bytes(ring_capacity: int) -> int:
        """Bytes allocate_violation_ring takes (ring and write index; ring_capacity checked as it checks it)."""
        return v.check_ring_capacity(ring_capacity) * layout.VIOLATION_FIELDS * 8 + 4

    def allocate_reason_counts(*, device) -> torch.Tensor:
        """Per-reason violation totals: int64 [VIOLATION_REASON_COUNT_COLUMNS] = 0 (column i = bit
        VIOLATION_REASON_COUNT_BITS[i])."""
        return torch.zeros(layout.VIOLATION_REASON_COUNT_COLUMNS, dtype=torch.int64,
                           device=v.check_device("device", device))

    def allocate_counter(*, device) -> torch.Tensor:
        """A run counter: int64 [1] = 0."""
        return allocate_counters(1, device=device)

    def allocate_counters(n: int, *, device) -> torch.Tensor:
        """`n` run counters in one tensor, int64 [n] = 0: `counters[i:i + 1]` is one context's counter,
        and one copy reads them all."""
        n = v.check_int("n", n, minimum=1)
        most = abi.RANGES["i64"][1] // 8  # torch counts a tensor's bytes in a signed 64-bit integer
        if n > most:
            raise ValueError(f"{v.prefix}n must be <= {most} (n int64 counters of 8 bytes each, counted in a "
                             f"signed 64-bit integer), got {n}")
        device = v.check_device("device", device)
        return allocate_or_explain(v, f"{n} run counters", n * 8, device,
                                   lambda: torch.zeros(n, dtype=torch.int64, device=device))

    def allocate_chain_position_flag(*, device, enabled: bool = False) -> torch.Tensor:
        """The write's chain-position-assert flag: int32 [1] (0 during warm-up / graph capture)."""
        v.check_bool("enabled", enabled)
        return torch.full((1,), int(enabled), dtype=torch.int32, device=v.check_device("device", device))

    def allocate_context(*, num_slots: int, ring_capacity: int, device, kernel_kind=next(iter(layout.CanaryLaunchTag)),
                         real_kv_sources: tuple = (), real_kv_hash_mode=layout.RealKvHashMode.NONE,
                         enable_chain_position_assert: bool = True,
                         slot_stride_bytes: int = layout.CANARY_SLOT_STRIDE_BYTES,
                         count_reasons: bool = True) -> VerifyOrWriteContext:
        """A fresh context with its own buffer, ring and counters (use dataclasses.replace to share a ring);
        per-reason totals are allocated unless count_reasons=False."""
        v.check_bool("count_reasons", count_reasons)
        kernel_kind = v.check_enum("kernel_kind", kernel_kind, layout.CanaryLaunchTag)
        real_kv_hash_mode = v.check_enum("real_kv_hash_mode", real_kv_hash_mode, layout.RealKvHashMode)
        device = v.check_device("device", device)
        real_kv_sources = v.check_real_kv_sources(real_kv_sources, device=device,  # before anything is allocated
                                                  mode=real_kv_hash_mode)
        ring, index = allocate_violation_ring(ring_capacity, device=device)
        return VerifyOrWriteContext(
            canary_buf=allocate_canary_buf(num_slots, device=device, slot_stride_bytes=slot_stride_bytes),
            kernel_kind=kernel_kind, violation_ring=ring, violation_write_index=index,
            slot_run_counter=allocate_counter(device=device), kernel_run_counter=allocate_counter(device=device),
            real_kv_sources=tuple(real_kv_sources), real_kv_hash_mode=real_kv_hash_mode,
            enable_chain_position_assert=allocate_chain_position_flag(device=device,
                                                                      enabled=enable_chain_position_assert),
            violation_reason_counts=allocate_reason_counts(device=device) if count_reasons else None)

    return SimpleNamespace(
        RealKvSource=RealKvSource, VerifyOrWriteContext=VerifyOrWriteContext, VerifyPlan=VerifyPlan,
        WritePlan=WritePlan, allocate_canary_buf=allocate_canary_buf, canary_buf_bytes=canary_buf_bytes,
        allocate_violation_ring=allocate_violation_ring, violation_ring_bytes=violation_ring_bytes,
        allocate_reason_counts=allocate_reason_counts, allocate_counter=allocate_counter,
        allocate_counters=allocate_counters, allocate_chain_position_flag=allocate_chain_position_flag,
        allocate_context=allocate_context, __all__=NAMES)
