"""The checks of one generated tree's launch data: its contexts, real-KV sources and plans
(docs/semantics.md §3, §4, §7), compute_slot_hash's inputs, and the tree's tensor rules per operation.

`Validators` extends the generic checks (kv_canary/launch/rules.py: tensor rules, scalar helpers)
with what the tree's data classes must be. A `VerifyOrWriteContext`, `RealKvSource`, `VerifyPlan`
or `WritePlan` of this tree (`classes`, kv_canary/launch/allocation.py tree_classes) checks itself
here when it is built, so a launch over them checks only their tensors again (in its operation,
kv_canary/launch/operations.py); a context or source of another class is checked here whole, at every
launch. `tensors[operation name]` holds an operation's generated rules (generated/kernel_abi.py
OPERATIONS) as named TensorRule records, converted once, with the operation's checks of the sizes they
bind (`Operation.size_checks`).

Every number, name and message comes from the tree's layout tables (generated/layout.py): the
record and ring sizes, the enums, the §7 texts with the schema's values already in them, and the
input fields a schema declares. Everything is checked from shapes, dtypes, data pointers and Python
arguments only: no device value is read, so validation never synchronises a GPU.
"""
from __future__ import annotations

import importlib
from typing import Any, Iterable, Optional

import torch

from .allocation import tree_classes
from .operations import REAL_KV_LAYOUT_FIELDS, real_kv_reach, source_layout
from .rules import FieldNames, Rules, operation_tensors

_INT64 = torch.int64
_UINT8 = torch.uint8


class Validators(Rules):
    """The checks of one tree (`layout`: the tree's generated layout module; `abi`: its generated
    kernel_abi module, by default the one beside the layout; `operations`: the operation objects whose
    tensors it holds rules for, kv_canary/launch/operations.py)."""

    def __init__(self, layout, abi=None, operations: Iterable = ()):
        super().__init__(layout, abi if abi is not None else
                         importlib.import_module(layout.__name__.rpartition(".")[0] + ".kernel_abi"))
        fields = layout.INPUT_FIELDS
        self.input_fields = _field_names(f.name for f in fields)
        self.per_request_fields = _field_names(f.name for f in fields if f.verify_expected == "per_request")
        self.per_slot_fields = _field_names(f.name for f in fields if f.verify_expected == "per_slot")
        # operation name -> its keywords as a dict, defaults filled in (generated); its tensors and rules
        self.keywords = {name: op.arguments for name, op in self.abi.OPERATIONS.items()}
        self.tensors = {op.name: operation_tensors(self.abi.OPERATIONS[op.name], op.size_checks(self))
                        for op in operations}
        self.partial_mode = layout.RealKvHashMode.PARTIAL
        self.source_names = tuple(f"real_kv_sources[{i}].tensor" for i in range(layout.MAX_REAL_KV_SOURCES))
        self.plan_fields = {"VerifyPlan": tuple(f[0] for f in self.abi.VERIFY_PLAN_FIELDS),
                            "WritePlan": tuple(f[0] for f in self.abi.WRITE_PLAN_FIELDS)}
        # This tree's launch data classes: what they hold besides tensors is checked when they are
        # built, not again at every launch.
        self.classes = tree_classes(layout, self)
        self.plan_classes = {"VerifyPlan": self.classes.verify_plan, "WritePlan": self.classes.write_plan}

    # -- buffers and plans --------------------------------------------------------------------------------
    def check_slot_stride(self, stride: int, shape: tuple) -> None:
        """A multiple of the word size holding the record (shape: the buffer's, for the message)."""
        word = self.layout.CANARY_WORD_BYTES
        if stride % word:
            raise ValueError(f"{self.prefix}canary_buf slot stride must be a multiple of {word} bytes, "
                             f"got {stride} (shape {tuple(shape)})")
        if stride // word < self.layout.CANARY_FIELDS_PER_SLOT:
            raise self.fail("canary_stride", n=stride // word)

    def check_ring_capacity(self, ring_capacity: Any) -> int:
        """>= 0; the ring's write index is a C int, so rows past 2**31-1 could never be written."""
        return self.check_fits("ring_capacity", self.check_int("ring_capacity", ring_capacity, minimum=0))

    def check_plan_class(self, plan: Any, cls: str) -> None:
        """A VerifyPlan or WritePlan (of this schema): every field its class has."""
        if type(plan) is self.plan_classes[cls]:
            return
        for attr in self.plan_fields[cls]:
            if not hasattr(plan, attr):
                of = " of this schema" if cls == "VerifyPlan" else ""
                raise TypeError(f"{self.prefix}plan must be a {cls}{of} (missing {attr}), got {type(plan).__name__}")

    # -- real-KV sources (docs/semantics.md §4) --------------------------------------------------------------
    def check_real_kv_params(self, *, page_size: Any, num_bytes_per_token: Any, read_bytes: Any) -> None:
        """A source's integers (fixed once a RealKvSource is built), in SGLang's order (§4): checked
        before its tensor (check_real_kv_tensor)."""
        align = self.layout.REAL_KV_LOAD_ALIGN_BYTES
        page_size = self.check_int("RealKvSource.page_size", page_size)
        num_bytes_per_token = self.check_int("RealKvSource.num_bytes_per_token", num_bytes_per_token)
        read_bytes = self.check_int("RealKvSource.read_bytes", read_bytes)
        if page_size < 1:
            raise self.fail("real_kv_page_size", page_size=page_size)
        if num_bytes_per_token <= 0 or num_bytes_per_token % align:
            raise self.fail("real_kv_num_bytes_per_token", n=num_bytes_per_token)
        if read_bytes <= 0 or read_bytes % align or read_bytes > num_bytes_per_token:
            raise self.fail("real_kv_read_bytes", n=num_bytes_per_token, r=read_bytes)
        # The kernels take these as C ints; their product (< 2**62 then) is computed in 64 bits, and a
        # row's byte offset (row * row stride) stays inside the tensor's own memory.
        for field, value in (("page_size", page_size), ("num_bytes_per_token", num_bytes_per_token),
                             ("read_bytes", read_bytes)):
            self.check_fits("RealKvSource." + field, value)

    # The layout fields of a RealKvSource (after SGLang's four), in the kernels' parameter order (operations.py).
    REAL_KV_LAYOUT_FIELDS = REAL_KV_LAYOUT_FIELDS

    def check_real_kv_layout(self, src: Any, num_bytes_per_token: int) -> tuple:
        """Where a source keeps a slot's bytes (its layout fields, SGLang's packed rows where it has
        none), checked against its valid num_bytes_per_token; returns them as ints, in
        REAL_KV_LAYOUT_FIELDS order. The kernels load a head's bytes `width` at a time (16, or a
        chunk of 2, 4 or 8 bytes), so every offset is a multiple of it."""
        token_stride = getattr(src, "token_stride_bytes", None)
        got = (num_bytes_per_token if token_stride is None else token_stride, getattr(src, "num_heads", 1),
               getattr(src, "head_stride_bytes", 0), getattr(src, "chunk_bytes", 0), getattr(src, "chunk_stride_bytes", 0),
               getattr(src, "token_group_size", 0), getattr(src, "token_group_stride_bytes", 0),
               getattr(src, "chunk_group_size", 0), getattr(src, "chunk_group_stride_bytes", 0))
        ts, heads, hs, chunk, cs, group, gs, cgroup, cgs = (self.check_fits("RealKvSource." + name, self.check_int("RealKvSource." + name, value))
                                    for name, value in zip(self.REAL_KV_LAYOUT_FIELDS, got))
        align = self.layout.REAL_KV_LOAD_ALIGN_BYTES

        def bad(field: str, expected: str, value: int) -> ValueError:
            return self.fail("real_kv_layout", field=field, expected=expected, got=value)
        if heads < 1 or num_bytes_per_token % (heads * align):
            raise bad("num_heads", f">= 1 and split num_bytes_per_token={num_bytes_per_token} into heads of a multiple "
                                   f"of {align} bytes", heads)
        head = num_bytes_per_token // heads
        if chunk not in (0, 2, 4, 8) and (chunk < 0 or chunk % align):
            raise bad("chunk_bytes", f"0 (a head's bytes contiguous), 2, 4, 8 or a positive multiple of {align}", chunk)
        if chunk and head % chunk:
            raise bad("chunk_bytes", f"a divisor of a head's {head} bytes (num_bytes_per_token / num_heads)", chunk)
        width = chunk if 0 < chunk < align else align
        if ts < 1 or ts % width:
            raise bad("token_stride_bytes", f"a positive multiple of {width} (the bytes the kernels load at once)", ts)
        if hs < 0 or hs % width or (heads > 1 and hs == 0):
            need = "a positive" if heads > 1 else "a non-negative"
            raise bad("head_stride_bytes", f"{need} multiple of {width} (num_heads={heads})", hs)
        if chunk == 0 and cs:
            raise bad("chunk_stride_bytes", "0 when chunk_bytes is 0 (a head's bytes contiguous)", cs)
        if chunk and head > chunk and (cs < chunk or cs % width):
            raise bad("chunk_stride_bytes", f"a multiple of {width} and >= chunk_bytes={chunk}", cs)
        if chunk and head == chunk and (cs < 0 or cs % width):  # one chunk per head: the stride is never used
            raise bad("chunk_stride_bytes", f"a non-negative multiple of {width}", cs)
        if group < 0:
            raise bad("token_group_size", "0 (no token groups) or a positive number of tokens", group)
        if group == 0 and gs:
            raise bad("token_group_stride_bytes", "0 when token_group_size is 0 (no token groups)", gs)
        if group and (gs < 0 or gs % width):
            raise bad("token_group_stride_bytes", f"a non-negative multiple of {width}", gs)
        if cgroup < 0 or (cgroup and not chunk):
            raise bad("chunk_group_size", "0 (no chunk groups), or a positive number of chunks when chunk_bytes > 0",
                      cgroup)
        if cgroup == 0 and cgs:
            raise bad("chunk_group_stride_bytes", "0 when chunk_group_size is 0 (no chunk groups)", cgs)
        if cgroup and (cgs < 0 or cgs % width):
            raise bad("chunk_group_stride_bytes", f"a non-negative multiple of {width}", cgs)
        return ts, heads, hs, chunk, cs, group, gs, cgroup, cgs

    def check_partial_read(self, sources: Any, mode: Any) -> None:
        """[extension] PARTIAL reads the first REAL_KV_PARTIAL_READ_BYTES of a slot: a source with fewer
        bytes per slot is refused (the kernels would read past the slot, and past the tensor for the
        last one). SGLang's constant (16) never exceeds a valid source's bytes."""
        partial = self.layout.REAL_KV_PARTIAL_READ_BYTES
        if mode == self.layout.RealKvHashMode.PARTIAL:
            for i, src in enumerate(sources):
                if src.num_bytes_per_token < partial:
                    raise self.fail("real_kv_partial", i=i, n=src.num_bytes_per_token)

    def check_real_kv_tensor(self, tensor: Any, *, page_size: int, num_bytes_per_token: int,
                             layout: Optional[tuple] = None) -> int:
        """A source's tensor, one check after the other (a write or verify checks the tensor of a valid
        source of this tree in one pass, kv_canary/launch/operations.py). `layout`: check_real_kv_layout's (None: packed rows). Returns the
        bytes from the tensor's first element to the end of the farthest one a slot reads."""
        if not isinstance(tensor, torch.Tensor):
            raise TypeError(f"{self.prefix}RealKvSource.tensor must be a torch.Tensor, got {type(tensor).__name__}")
        self.check_has_data("RealKvSource.tensor", tensor)
        size, strides = tensor.shape, tensor.stride()
        if len(size) < 2:
            raise self.fail("real_kv_tensor_rank", shape=tuple(tensor.shape))
        align = self.layout.REAL_KV_LOAD_ALIGN_BYTES
        es = tensor.element_size()
        row_stride = strides[0] * es
        packed, width, reach = (True, align, 0) if layout is None else \
            real_kv_reach(num_bytes_per_token, page_size, layout, align)
        if not packed:
            # Slots are gathered where the layout puts them: no row shape to check, but every load
            # aligned and the farthest byte any slot of any row reads inside the tensor's storage.
            if row_stride % width:
                raise self.fail("real_kv_layout", field="tensor row stride (stride(0) x element size)",
                                expected=f"a multiple of {width} bytes", got=row_stride)
            self.check_aligned("RealKvSource.tensor", tensor, width)
            end = (size[0] - 1) * row_stride + reach if size[0] else 0
            have = tensor.untyped_storage().nbytes() - tensor.storage_offset() * es
            if end > have:
                raise self.fail("real_kv_extent", end=end, have=have, shape=tuple(size), strides=tuple(strides),
                                dtype=tensor.dtype)
            return end
        if row_stride % align:
            raise self.fail("real_kv_row_stride", b=row_stride, shape=tuple(tensor.shape), strides=tuple(strides), dtype=tensor.dtype)
        # A row's bytes are read as one flat run starting at the row's first element.
        packed = 1
        for d in range(len(size) - 1, 0, -1):
            if size[d] != 1 and strides[d] != packed and size[0] > 0:
                raise ValueError(f"{self.prefix}RealKvSource.tensor must be contiguous inside a row (dims 1..), "
                                 f"got shape={tuple(tensor.shape)}, strides={tuple(strides)}")
            packed *= size[d]
        needed = page_size * num_bytes_per_token
        if packed * es < needed:
            raise self.fail("real_kv_row_width", b=packed * es, p=page_size, n=num_bytes_per_token, m=needed)
        self.check_aligned("RealKvSource.tensor", tensor, align)
        self.check_storage("RealKvSource.tensor", tensor)
        return self.extent(tensor)

    def check_real_kv_source(self, i: int, src: Any, device: torch.device) -> tuple:
        """real_kv_sources[i] whole, one check after the other (the first that is wrong raises): a
        RealKvSource's fields, its integers, its layout, its tensor and its device. Returns (data
        pointer, bytes read from it, stride(0), element size, rows)."""
        for attr in ("tensor", "page_size", "num_bytes_per_token", "read_bytes"):
            if not hasattr(src, attr):
                raise TypeError(f"{self.prefix}real_kv_sources[{i}] must be a RealKvSource, got {type(src).__name__}")
        self.check_real_kv_params(page_size=src.page_size, num_bytes_per_token=src.num_bytes_per_token,
                                  read_bytes=src.read_bytes)
        layout = self.check_real_kv_layout(src, src.num_bytes_per_token)
        t = src.tensor
        reach = self.check_real_kv_tensor(t, page_size=src.page_size, num_bytes_per_token=src.num_bytes_per_token,
                                          layout=layout)
        if t.device != device:
            raise ValueError(f"{self.prefix}real_kv_sources[{i}].tensor must be on {device} (the device of "
                             f"canary_buf), got {t.device}")
        # a strided layout may read past the view, inside the storage
        return t.data_ptr(), max(self.extent(t), reach), t.stride(0), t.element_size(), t.shape[0]

    def check_real_kv_sources(self, sources: Any, *, device: torch.device, mode: Any = None) -> tuple:
        """A list of sources before a context is allocated over them: the list, each source whole,
        then what the hash mode `mode` reads of them (PARTIAL: check_partial_read)."""
        self.check_source_list(sources)
        for i, src in enumerate(sources):
            self.check_real_kv_source(i, src, device)
        if mode == self.partial_mode:
            self.check_partial_read(sources, mode)
        return tuple(sources)

    # -- contexts -------------------------------------------------------------------------------------------
    def check_context_fields(self, context: Any) -> None:
        """What a context holds besides its tensors: its fields, launch tag, hash mode and real-KV
        sources (checked once when this tree's VerifyOrWriteContext is built, else at every launch)."""
        for attr in ("canary_buf", "kernel_kind", "violation_ring", "violation_write_index", "slot_run_counter",
                     "kernel_run_counter", "real_kv_sources", "real_kv_hash_mode", "enable_chain_position_assert"):
            if not hasattr(context, attr):
                raise TypeError(f"{self.prefix}context must be a VerifyOrWriteContext (missing {attr}), got {type(context).__name__}")
        self.check_enum("kernel_kind", context.kernel_kind, self.layout.CanaryLaunchTag)
        self.check_enum("real_kv_hash_mode", context.real_kv_hash_mode, self.layout.RealKvHashMode)
        self.check_source_list(context.real_kv_sources)

    def check_source_list(self, sources: Any) -> None:
        """real_kv_sources as a context holds it: a tuple (or list) of at most MAX_REAL_KV_SOURCES."""
        if not isinstance(sources, (tuple, list)):
            raise TypeError(f"{self.prefix}real_kv_sources must be a tuple of RealKvSource, got {type(sources).__name__}")
        if len(sources) > self.layout.MAX_REAL_KV_SOURCES:
            raise self.fail("real_kv_source_count", n=len(sources))

    def check_context_disjoint(self, context: Any) -> None:
        """No two of a context's tensors share memory: what a launch reads of it (real-KV bytes, the
        flag, for a verify the canary buffer) is never what it writes (the ring and counters every
        launch writes; for a write the canary buffer)."""
        def spans(tensors: dict, output: bool) -> list:  # for check_spans; what has no memory has no span
            return [(t.data_ptr(), t.data_ptr() + self.extent(t), name, output) for name, t in tensors.items()
                    if isinstance(t, torch.Tensor) and t.data_ptr() and self.extent(t)]
        inputs = spans({"enable_chain_position_assert": context.enable_chain_position_assert,
                        **{f"real_kv_sources[{i}].tensor": getattr(src, "tensor", None)
                           for i, src in enumerate(context.real_kv_sources)}}, False)
        for i, src in enumerate(context.real_kv_sources):  # a built source's layout may read past its view
            if type(src) is self.classes.source and src.tensor.data_ptr():
                t = src.tensor
                reach = real_kv_reach(src.num_bytes_per_token, src.page_size, source_layout(src),
                                      self.layout.REAL_KV_LOAD_ALIGN_BYTES)[2] + (t.shape[0] - 1) * t.stride(0) * t.element_size()
                if t.shape[0] and reach > self.extent(t):
                    inputs.append((t.data_ptr(), t.data_ptr() + reach, f"real_kv_sources[{i}].tensor", False))
        outputs = spans({name: getattr(context, name, None) for name in (
            "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter",
            "violation_reason_counts")}, True)
        buf = {"canary_buf": context.canary_buf}
        self.check_spans(inputs + spans(buf, False) + outputs)
        self.check_spans(inputs + spans(buf, True))

    def validate_slot_hash(self, *, buf_i64, source_slot_idx) -> dict:
        """compute_slot_hash's inputs: the buffer as int64 [num_slots, words] (SGLang's form, any strides)
        or the uint8 canary_buf (viewed as int64 here), and a slot below num_slots (negative: HEAD)."""
        if not isinstance(buf_i64, torch.Tensor):
            raise TypeError(f"{self.prefix}buf_i64 must be a torch.Tensor, got {type(buf_i64).__name__}")
        if buf_i64.dtype == _UINT8:  # the canary_buf: contiguous, its stride holding the record, word-aligned
            self.check_tensor("canary_buf", buf_i64, dtype=_UINT8, ndim=2)
            self.check_slot_stride(buf_i64.shape[1], buf_i64.shape)
            word = self.layout.CANARY_WORD_BYTES
            self.check_aligned("canary_buf", buf_i64, word, f"{word}-byte record words")
            buf_i64 = buf_i64.view(_INT64)
        elif buf_i64.dtype == _INT64:
            self.check_tensor("buf_i64", buf_i64, dtype=_INT64, ndim=2, contiguous=False)
            if int(buf_i64.shape[1]) < self.layout.CANARY_FIELDS_PER_SLOT:
                raise ValueError(f"{self.prefix}buf_i64 must hold at least {self.layout.CANARY_FIELDS_PER_SLOT} int64 "
                                 f"fields per slot (dim 1), got shape {tuple(buf_i64.shape)}")
        else:
            raise TypeError(f"{self.prefix}buf_i64 must have dtype torch.int64 (the canary buffer viewed as int64 "
                            f"[num_slots, words]) or be the uint8 canary_buf, got {buf_i64.dtype}")
        slot = self.check_int("source_slot_idx", source_slot_idx)
        num_slots = int(buf_i64.shape[0])
        if slot >= num_slots:
            raise ValueError(f"{self.prefix}source_slot_idx must be < {num_slots} (the slots of buf_i64) or negative "
                             f"(the chain head), got {slot}")
        return dict(buf_i64=buf_i64, source_slot_idx=slot)


def _field_names(names) -> FieldNames:
    names = tuple(names)
    return FieldNames(names, frozenset(names))
