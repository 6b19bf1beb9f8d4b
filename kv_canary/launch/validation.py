"""Host-side validation of every launch (docs/semantics.md §7), for one generated layer.

Every tensor of an operation is checked against its rule in the layer's generated kernel ABI
(generated/kernel_abi.py OPERATIONS, rendered from the operation table codegen/operations.py):
dtype, dims, device, contiguity, alignment, its extent against its storage, and no input sharing
memory with an output. `check_tensors` reads each tensor's attributes once; a tensor that breaks
its rule is handed to `check_tensor`, which names the first thing that is wrong. What is left here
by hand is what a rule cannot say: scalars, mappings of input fields, real-KV sources and the
relations between sizes (a capacity above 0, requests within the write capacity).

Every number, name and message comes from the layer's layout tables (generated/layout.py): the
record and ring sizes, the enums, the §7 texts with the schema's values already in them, and the
input fields a schema declares. Which Python integers must fit which C integer of the kernels comes
from the layer's kernel ABI (generated/kernel_abi.py ARGUMENT_KINDS and RANGES, rendered from the
one description of every kernel parameter), so a value no kernel can hold is refused here, with
the argument's own name, on every backend alike (the torch reference included). Everything is
checked from shapes, dtypes, data pointers and Python arguments only: no device value is read, so
validation never synchronises a GPU. Backends may assume validated inputs. `check(operation, arguments)`
returns the keyword arguments the backend operation takes, normalised (input-field mappings become
dicts with exactly the schema's keys).
"""
from __future__ import annotations

import importlib
import operator
from typing import Any, Mapping, NamedTuple, Optional

import torch

_INT64 = torch.int64
_INT32 = torch.int32
_UINT8 = torch.uint8
_TENSOR = torch.Tensor
_DTYPES = {"uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}
_ANY, _EQUALS, _BINDS, _MATCHES = range(4)  # what a rule's dimension does (see _Rule)
_FIXED, _GENERAL = 4, 5  # a rule's shape as a whole: every size fixed; any other rank-N check


def _bound(value: int) -> str:
    """2147483647 as '2**31-1 = 2147483647' (the C limits read better as powers of two)."""
    if value > 0 and (value + 1) & value == 0:
        return f"2**{(value + 1).bit_length() - 1}-1 = {value}"
    if value < 0 and (-value) & (-value - 1) == 0:
        return f"-2**{(-value).bit_length() - 1} = {value}"
    return str(value)


class _Rule:
    """One generated tensor rule, ready to check: `dims` as (what, value, offset) per dimension."""
    __slots__ = ("name", "dtype", "dims", "rank", "output", "optional", "contiguous", "align", "words", "overlap",
                 "binds", "fixed", "one", "es", "align_bytes")

    def __init__(self, name, dtype, dims, role, optional, contiguous, align, words, overlap, bound: set):
        self.name, self.dtype, self.rank, self.output = name, _DTYPES[dtype], len(dims), role == "output"
        self.optional, self.contiguous, self.align, self.words, self.overlap = optional, contiguous, align, words, overlap
        out = []
        for d in dims:
            if d is None:
                out.append((_ANY, None, 0))
            elif isinstance(d, int):
                out.append((_EQUALS, d, 0))
            else:
                symbol, _, plus = d.partition("+")
                if plus or symbol in bound:
                    out.append((_MATCHES, symbol, int(plus or 0)))
                else:
                    bound.add(symbol)
                    out.append((_BINDS, symbol, 0))
        self.dims = tuple(out)
        self.binds = tuple(value for what, value, _ in out if what == _BINDS)
        self.es = self.dtype.itemsize
        self.align_bytes = align or self.es
        # The two common cases, checked without a loop: every size fixed, or one dimension.
        self.fixed = torch.Size(d for _, d, _ in out) if all(what == _EQUALS for what, _, _ in out) else None
        self.one = out[0] if len(out) == 1 and self.fixed is None else None


class CompiledRule(NamedTuple):
    """One rule as check_tensors reads it, in the order its loop unpacks it (a tuple: no attribute
    lookups at every launch)."""
    dtype: torch.dtype
    kind: int                 # _FIXED, _GENERAL, or its one dimension's _BINDS / _MATCHES / _ANY
    a1: Any                   # _FIXED: the shape; one dimension: the size symbol (or None)
    a2: int                   # _MATCHES: the offset ("cap+1")
    align: int                # the address must be a multiple of it (bytes)
    element_size: int
    output: bool
    optional: bool
    after: Optional[tuple]    # the size checks to run once it passed (Validators._size_checks), or None
    overlap: Optional[str]    # the name it is reported under when it shares memory
    rule: _Rule               # the whole rule, for refuse (the first thing that is wrong)


def _compile(rules, checks: dict) -> tuple:
    """Each generated rule as a CompiledRule."""
    bound: set = set()
    out = []
    for r in map(lambda rule: _Rule(*rule, bound=bound), rules):
        if r.fixed is not None:
            kind, a1, a2 = _FIXED, r.fixed, 0
        elif r.one is not None:
            kind, a1, a2 = r.one  # one dimension: _BINDS, _MATCHES or _ANY
        else:
            kind, a1, a2 = _GENERAL, None, 0
        after = tuple(checks[size] for size in r.binds if size in checks) or None
        out.append(CompiledRule(r.dtype, kind, a1, a2, r.align_bytes, r.es, r.output, r.optional, after, r.overlap, r))
    return tuple(out)


class Validators:
    """The checks of one layer (`layout`: the layer's generated layout module; `abi`: its generated
    kernel_abi module, by default the one beside the layout)."""

    def __init__(self, layout, abi=None):
        self.layout = layout
        self.abi = abi if abi is not None else importlib.import_module(layout.__name__.rpartition(".")[0] + ".kernel_abi")
        self.prefix = layout.MESSAGE_PREFIX
        # This layer's frozen launch classes (adopt): what they hold besides tensors is checked when
        # they are built, not again at every launch.
        self.frozen_context = self.frozen_source = None
        self.frozen_plans: dict = {}
        self.ranges = {argument: self.abi.RANGES[kind] for argument, kind in self.abi.ARGUMENT_KINDS.items()}
        fields = layout.INPUT_FIELDS
        self.input_fields = tuple(f.name for f in fields)
        self.per_request_fields = tuple(f.name for f in fields if f.verify_expected == "per_request")
        self.per_slot_fields = tuple(f.name for f in fields if f.verify_expected == "per_slot")
        bound = self._size_checks()
        # operation -> (its tensors, its compiled rules, the device's tensor, its keywords as a dict)
        self.operations = {name: (op.tensors, _compile(op.rules, bound.get(name, {})), op.device_of, op.arguments)
                           for name, op in self.abi.OPERATIONS.items()}
        self.key_sets = {names: frozenset(names) for names in (self.input_fields, self.per_request_fields,
                                                               self.per_slot_fields)}
        self.partial_mode = layout.RealKvHashMode.PARTIAL
        self.source_names = tuple(f"real_kv_sources[{i}].tensor" for i in range(layout.MAX_REAL_KV_SOURCES))
        self.plan_classes = {"VerifyPlan": tuple(f[0] for f in self.abi.VERIFY_PLAN_FIELDS),
                             "WritePlan": tuple(f[0] for f in self.abi.WRITE_PLAN_FIELDS)}

    def adopt(self, *, context: type, source: type, plans: dict) -> None:
        """This layer's frozen launch classes (kv_canary/launch/allocation.py allocators_for makes them)."""
        self.frozen_context, self.frozen_source, self.frozen_plans = context, source, dict(plans)

    def message(self, key: str, **values: Any) -> str:
        """The full §7 text of `key` with its run-time values filled in."""
        return self.prefix + self.layout.MESSAGES[key].format(**values)

    def fail(self, key: str, **values: Any) -> ValueError:
        return ValueError(self.message(key, **values))

    # -- the operations' tensors (generated rules) ------------------------------------------------------
    def check_tensors(self, operation: str, args: dict) -> tuple[dict, list]:
        """Every tensor of `operation` against its generated rule; returns the sizes the rules bound
        ({"n": tokens, "cap": capacity, ...}) and the (first byte, end, name, output?) spans of its
        tensors (for check_spans). One read of each attribute per tensor; a tensor that breaks its
        rule goes to refuse, which raises with the first thing that is wrong. The size checks of the
        operation (_size_checks: a capacity above 0) run as soon as the tensor binding the size passed."""
        tensors, compiled, device_of, _ = self.operations[operation]
        sizes: dict = {}
        spans: list = []
        ts = tensors(args)
        first = ts[0]  # the device_of tensor: every other one must share its device
        dev = first.device if type(first) is _TENSOR and not first.is_meta else None
        cpu = dev is not None and first.is_cpu  # is_cpu reads faster than a device object (or its type)
        for (dtype, kind, a1, a2, align, es, output, optional, after, overlap, rule), t in zip(compiled, ts):
            if t is None and optional:
                continue
            ok = (type(t) is _TENSOR and t.dtype is dtype and (t.is_cpu if cpu else t.device == dev)
                  and t.is_contiguous())
            if ok:
                shape = t.shape
                if kind == _FIXED:
                    ok = shape == a1
                elif len(shape) != 1:
                    ok = kind == _GENERAL and self._dims(rule, shape, sizes)
                elif kind == _BINDS:
                    sizes[a1] = shape[0]
                elif kind == _MATCHES:
                    ok = shape[0] == sizes[a1] + a2
                elif kind != _ANY:
                    ok = self._dims(rule, shape, sizes)  # a rule of another rank: refused
            if ok:
                ptr, n = t.data_ptr(), t.nbytes
                ok = not ptr % align and t.storage_offset() * es + n <= t.untyped_storage().nbytes()
            if not ok:
                self.refuse(rule, t, sizes, dev, device_of, self._binders(compiled, ts, rule))  # raises, but
                # for a valid non-contiguous tensor
                for (what, value, _), got in zip(rule.dims, t.shape):
                    if what == _BINDS:
                        sizes[value] = got
                if dev is None:
                    dev = t.device
                    cpu = dev.type == "cpu"
                ptr, n = t.data_ptr(), self.extent(t)
            if n and ptr:
                spans.append((ptr, ptr + n, overlap, output))
            if after is not None:
                for check in after:
                    check(sizes)
        return sizes, spans

    @staticmethod
    def _dims(rule: "_Rule", shape, sizes: dict) -> bool:
        """`shape` against a rule of any rank, binding the sizes its symbols name first."""
        if len(shape) != rule.rank:
            return False
        for (what, value, plus), got in zip(rule.dims, shape):
            if what == _EQUALS:
                if got != value:
                    return False
            elif what == _MATCHES:
                if got != sizes[value] + plus:
                    return False
            elif what == _BINDS:
                sizes[value] = got
        return True

    @staticmethod
    def _binders(compiled, ts, rule: "_Rule") -> dict:
        """symbol -> (argument, dimension, its rank) that bound it before `rule`: the first tensor given whose
        rule binds it (what a size mismatch is a mismatch with). Only on the refusal path."""
        found: dict = {}
        for entry, t in zip(compiled, ts):
            other = entry.rule
            if other is rule:
                break
            if t is None:
                continue
            for dim, (what, value, _) in enumerate(other.dims):
                if what == _BINDS:
                    found.setdefault(value, (other.name, dim, other.rank))
        return found

    def refuse(self, rule: _Rule, t: Any, sizes: dict, device, device_of: str, binders: Optional[dict] = None) -> None:
        """Raise the text of the first thing `t` breaks of `rule` (the checks one by one); a size
        that must match another argument's names that argument too."""
        shape = tuple(value if what == _EQUALS else sizes[value] + plus if what == _MATCHES else None
                      for what, value, plus in rule.dims)
        dims = dict(ndim=rule.rank) if all(d is None for d in shape) else dict(shape=shape)
        matched = []
        for dim, (what, value, plus) in enumerate(rule.dims):
            if what == _MATCHES and (binders or {}).get(value) is not None:
                other, other_dim, other_rank = binders[value]
                size = f"the length of {other}" if other_rank == 1 else f"dimension {other_dim} of {other}"
                mine = "its length" if rule.rank == 1 else f"dimension {dim}"
                matched.append(f"{mine} must equal {size} ({sizes[value]}){f' + {plus}' if plus else ''}")
        try:
            self.check_tensor(rule.name, t, dtype=rule.dtype, device=device, device_of=device_of,
                              contiguous=rule.contiguous, **dims)
        except ValueError as e:
            if matched and " must have shape " in str(e):
                raise ValueError(f"{e}: {'; '.join(matched)}") from None
            raise
        if rule.align:
            self.check_aligned(rule.name, t, rule.align, rule.words)

    def check_spans(self, spans: list) -> None:
        """No input shares memory with an output of the same launch, and no two outputs share memory:
        a kernel reading what it writes, or two of its outputs landing in one place, gives different
        results on different backends (thread order, copies), so it is refused. Checked at every
        validated launch, so a tensor re-pointed after its context was built (`set_`) is caught too.
        `spans`: (first byte, end, name, output?); one pass in address order, keeping the furthest
        end of the inputs and of the outputs seen so far."""
        in_end = out_end = 0
        in_name = out_name = ""
        for start, end, name, output in sorted(spans):
            if output:
                if start < in_end:
                    self.refuse_overlap(in_name, name)
                if start < out_end:
                    raise ValueError(f"{self.prefix}{name} overlaps {out_name}: this launch writes both, and its "
                                     f"outputs must not share memory (give each its own tensor)")
                if end > out_end:
                    out_end, out_name = end, name
            else:
                if start < out_end:
                    self.refuse_overlap(name, out_name)
                if end > in_end:
                    in_end, in_name = end, name

    def refuse_overlap(self, name: str, out: str) -> None:
        raise ValueError(f"{self.prefix}{name} overlaps {out}, which this launch writes: inputs and "
                         f"outputs must not share memory (pass a copy of {name})")

    def check_tensor(self, name: str, t: Any, *, dtype: torch.dtype, shape: Optional[tuple] = None, ndim: Optional[int] = None,
                     device: Optional[torch.device] = None, device_of: str = "canary_buf", contiguous: bool = True) -> None:
        """Type, dtype, rank, shape (None entries match anything), device, contiguity, alignment and
        storage extent of one tensor, one by one: the first that is wrong raises."""
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{self.prefix}{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dtype != dtype:
            raise TypeError(f"{self.prefix}{name} must have dtype {dtype}, got {t.dtype}")
        want_ndim = len(shape) if shape is not None else ndim
        if want_ndim is not None and t.dim() != want_ndim:
            raise ValueError(f"{self.prefix}{name} must be {want_ndim}-D, got shape {tuple(t.shape)}")
        if shape is not None and any(w is not None and w != g for w, g in zip(shape, t.shape)):
            want = "(" + ", ".join("*" if w is None else str(w) for w in shape) + ("," if len(shape) == 1 else "") + ")"
            raise ValueError(f"{self.prefix}{name} must have shape {want}, got {tuple(t.shape)}")
        if device is not None and t.device != device:
            raise ValueError(f"{self.prefix}{name} must be on {device} (the device of {device_of}), got {t.device}")
        self.check_has_data(name, t)
        if contiguous and not t.is_contiguous():
            raise self.fail("not_contiguous", name=name)
        self.check_aligned(name, t, t.element_size(), f"its {t.dtype} elements")
        self.check_storage(name, t)

    def check_has_data(self, name: str, t: torch.Tensor) -> None:
        """A meta tensor has a shape but no memory: no backend can read or write it."""
        if t.is_meta:
            raise ValueError(f"{self.prefix}{name} is on the meta device, which holds no data; kv-canary launches "
                             f"need tensors with memory (e.g. on cpu or cuda)")

    def check_aligned(self, name: str, t: torch.Tensor, align: int, words: str = "") -> None:
        """The kernels read `t` as `align`-byte words: a misaligned address faults on a GPU and is
        undefined behaviour on the host (e.g. a uint8 view at an odd offset, an unaligned numpy buffer)."""
        if t.data_ptr() % align:
            why = f" (the kernels read it as {words})" if words else ""
            raise ValueError(f"{self.prefix}{name} data must be {align}-byte aligned{why}, got address "
                             f"{t.data_ptr():#x} (storage offset {t.storage_offset()} elements)")

    def check_storage(self, name: str, t: torch.Tensor) -> None:
        """Every element the shape and strides reach lies inside the tensor's storage (a storage
        resized under a tensor keeps the tensor's shape, and a kernel would run past the memory)."""
        have, need = t.untyped_storage().nbytes(), self.extent(t)
        end = t.storage_offset() * t.element_size() + need
        if need and end > have:
            raise ValueError(f"{self.prefix}{name} reaches {end} bytes into its storage (shape {tuple(t.shape)}, strides "
                             f"{tuple(t.stride())}, storage offset {t.storage_offset()}), but the storage holds {have} "
                             f"bytes: was it resized under the tensor?")

    @staticmethod
    def extent(t: torch.Tensor) -> int:
        """Bytes from the tensor's first element to one past its last (0 for an empty tensor)."""
        if t.is_contiguous() or t.numel() == 0:
            return t.nbytes
        return (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()

    # -- integers that reach the kernels as C integers -----------------------------------------------
    def check_fits(self, name: str, value: int, *, argument: Optional[str] = None) -> int:
        """`value` within the C integer of the kernels that takes argument `argument` (default: `name`;
        the kind comes from the generated kernel ABI, never from a table here)."""
        lo, hi = self.ranges[argument or name]
        if not lo <= value <= hi:
            kind = self.abi.ARGUMENT_KINDS[argument or name]
            side, bound = ("<=", hi) if value > hi else (">=", lo)
            raise ValueError(f"{self.prefix}{name} must be {side} {_bound(bound)} (the kernels hold it in a C "
                             f"{self.abi.C_NAMES[kind]}), got {value}")
        return value

    def check_extent(self, what: str, count: int, count_name: str, size: int, size_name: str,
                     unit: str = "bytes") -> None:
        """count x size within int64: the kernels compute such products (slot * stride, row * row
        stride, the plan's entry total) in signed 64-bit integers."""
        most = self.abi.RANGES["i64"][1]
        if count * size > most:
            raise ValueError(f"{self.prefix}{what} is too large: {count_name}={count} x {size_name}={size} = "
                             f"{count * size} {unit}, more than a signed 64-bit integer holds "
                             f"({_bound(most)}); the kernels compute it in one")

    def check_int(self, name: str, value: Any, *, minimum: Optional[int] = None) -> int:
        """An integer argument (at least `minimum`, if given): Python ints and numpy integer scalars
        (operator.index), never bools."""
        if type(value) is not int:
            try:
                if isinstance(value, bool):  # an int to operator.index, never an integer argument here
                    raise TypeError
                value = operator.index(value)
            except TypeError:
                raise TypeError(f"{self.prefix}{name} must be an int, got {type(value).__name__}") from None
        if minimum is not None and value < minimum:
            raise ValueError(f"{self.prefix}{name} must be >= {minimum}, got {value}")
        return value

    def check_enum(self, name: str, value: Any, enum_type):
        """A member of one of the schema's enums, given as the member or its int value."""
        try:
            return enum_type(self.check_int(name, value))
        except (TypeError, ValueError):
            members = ", ".join(f"{m.name}={int(m)}" for m in enum_type)
            raise ValueError(f"{self.prefix}{name} must be a {enum_type.__name__} ({members}), got {value!r}") from None

    def parse_device(self, name: str, device: Any) -> torch.device:
        """A well-formed device (a torch.device or a string such as 'cpu' or 'cuda:0')."""
        try:
            return torch.device(device)
        except (RuntimeError, TypeError):
            raise ValueError(f"{self.prefix}{name} must be a torch.device or a device string such as 'cpu' or "
                             f"'cuda:0', got {device!r}") from None

    def check_device(self, name: str, device: Any) -> torch.device:
        """A device to allocate on: well formed, and for CUDA one this torch build can reach."""
        dev = self.parse_device(name, device)
        if dev.type == "cuda":
            if not torch.cuda.is_available():
                why = ("this torch build has no CUDA support" if torch.version.cuda is None
                       else "torch sees no CUDA device")
                raise ValueError(f"{self.prefix}{name} is {str(dev)!r}, but {why}; allocate on 'cpu' instead")
            count = torch.cuda.device_count()
            if dev.index is not None and not 0 <= dev.index < count:
                raise ValueError(f"{self.prefix}{name} is {str(dev)!r}, but torch sees {count} CUDA device(s) "
                                 f"(cuda:0 .. cuda:{count - 1})")
        return dev

    def check_bool(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{self.prefix}{name} must be a bool, got {type(value).__name__}")
        return value

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

    # The layout fields of a RealKvSource (after SGLang's four), in the kernels' parameter order.
    REAL_KV_LAYOUT_FIELDS = ("token_stride_bytes", "num_heads", "head_stride_bytes", "chunk_bytes", "chunk_stride_bytes")

    def check_real_kv_layout(self, src: Any, num_bytes_per_token: int) -> tuple:
        """Where a source keeps a slot's bytes (its layout fields, SGLang's packed rows where it has
        none), checked against its valid num_bytes_per_token; returns them as ints, in
        REAL_KV_LAYOUT_FIELDS order. The kernels load a head's bytes `width` at a time (16, or a
        chunk of 2, 4 or 8 bytes), so every offset is a multiple of it."""
        token_stride = getattr(src, "token_stride_bytes", None)
        got = (num_bytes_per_token if token_stride is None else token_stride, getattr(src, "num_heads", 1),
               getattr(src, "head_stride_bytes", 0), getattr(src, "chunk_bytes", 0), getattr(src, "chunk_stride_bytes", 0))
        ts, heads, hs, chunk, cs = (self.check_fits("RealKvSource." + name, self.check_int("RealKvSource." + name, value))
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
        return ts, heads, hs, chunk, cs

    def real_kv_layout_reach(self, num_bytes_per_token: int, page_size: int, layout: tuple) -> tuple[bool, int, int]:
        """(packed: SGLang's layout, the load width, the end of the farthest byte one row's slots read
        relative to the row's first byte)."""
        ts, heads, hs, chunk, cs = layout
        align = self.layout.REAL_KV_LOAD_ALIGN_BYTES
        head = num_bytes_per_token // heads
        last_head = (heads - 1) * hs + ((head // chunk - 1) * cs + chunk if chunk else head)
        return (ts == num_bytes_per_token and heads == 1 and chunk == 0,
                chunk if 0 < chunk < align else align, (page_size - 1) * ts + last_head)

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
        """A source's tensor, one check after the other (check_real_kv_sources passes a valid tensor of
        a frozen source in one). `layout`: check_real_kv_layout's (None: packed rows). Returns the
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
            self.real_kv_layout_reach(num_bytes_per_token, page_size, layout)
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

    def check_real_kv_sources(self, sources: Any, *, device: torch.device, mode: Any = None, frozen: bool = False,
                              spans: Optional[list] = None, read: Optional[list] = None) -> tuple:
        """`frozen`: a frozen context's sources (their list checked when it was built), of which this
        layer's RealKvSource objects have only their tensors checked again (their integers were when
        built). `mode`: the context's hash mode (PARTIAL: check_partial_read). `spans` collects the
        spans the sources are read in (inputs), `read` what the binding takes (the kernels' real-KV block)."""
        if not frozen:
            self.check_source_list(sources)
        align = self.layout.REAL_KV_LOAD_ALIGN_BYTES
        cpu = device.type == "cpu"  # is_cpu reads faster than a device object
        for i, src in enumerate(sources):
            ok = False
            if frozen and type(src) is self.frozen_source:
                layout = (src.token_stride_bytes, src.num_heads, src.head_stride_bytes, src.chunk_bytes,
                          src.chunk_stride_bytes)
                # The usual case, in one pass: a contiguous tensor of packed rows, on the device, in its storage.
                t = src.tensor
                if (type(t) is _TENSOR and (t.is_cpu if cpu else t.device == device) and t.is_contiguous()
                        and src.num_heads == 1 and src.chunk_bytes == 0
                        and src.token_stride_bytes == src.num_bytes_per_token):
                    ptr, n, es, size, strides = t.data_ptr(), t.nbytes, t.itemsize, t.shape, t.stride()
                    ok = (len(size) >= 2 and size[0] and not ptr % align and not strides[0] * es % align
                          and n // size[0] >= src.page_size * src.num_bytes_per_token
                          and t.storage_offset() * es + n <= t.untyped_storage().nbytes())
            else:
                for attr in ("tensor", "page_size", "num_bytes_per_token", "read_bytes"):
                    if not hasattr(src, attr):
                        raise TypeError(f"{self.prefix}real_kv_sources[{i}] must be a RealKvSource, got {type(src).__name__}")
                self.check_real_kv_params(page_size=src.page_size, num_bytes_per_token=src.num_bytes_per_token,
                                          read_bytes=src.read_bytes)
                layout = self.check_real_kv_layout(src, src.num_bytes_per_token)
            if not ok:  # one check after the other: the first that is wrong raises
                t = src.tensor
                reach = self.check_real_kv_tensor(t, page_size=src.page_size, num_bytes_per_token=src.num_bytes_per_token,
                                                  layout=layout)
                if t.device != device:
                    raise ValueError(f"{self.prefix}real_kv_sources[{i}].tensor must be on {device} (the device of "
                                     f"canary_buf), got {t.device}")
                ptr, es, size, strides = t.data_ptr(), t.element_size(), t.shape, t.stride()
                n = max(self.extent(t), reach)  # a strided layout may read past the view, inside the storage
            if spans is not None and n and ptr:
                spans.append((ptr, ptr + n, self.source_names[i], False))
            if read is not None:
                read.append((ptr, strides[0], es, size[0]))
        if mode == self.partial_mode:
            self.check_partial_read(sources, mode)
        return tuple(sources)

    # -- buffers and plans --------------------------------------------------------------------------------
    def check_slot_stride(self, stride: int, shape: tuple) -> None:
        """A multiple of the word size holding the record (shape: the buffer's, for the message)."""
        word = self.layout.CANARY_WORD_BYTES
        if stride % word:
            raise ValueError(f"{self.prefix}canary_buf slot stride must be a multiple of {word} bytes, "
                             f"got {stride} (shape {tuple(shape)})")
        if stride // word < self.layout.CANARY_FIELDS_PER_SLOT:
            raise self.fail("canary_stride", n=stride // word)

    def check_capacity(self, name: str, value: Any, message: str, argument: Optional[str] = None) -> int:
        """A positive int (numpy integer scalars too) that fits the C int the kernels count it in
        (`argument`: the kernel argument that takes it, default `name`; "" for a size with no C int)."""
        value = self.check_int(name, value)
        if value <= 0:
            raise self.fail(message, n=value)
        return self.check_fits(name, value, argument=argument) if argument != "" else value

    def check_ring_capacity(self, ring_capacity: Any) -> int:
        """>= 0; the ring's write index is a C int, so rows past 2**31-1 could never be written."""
        return self.check_fits("ring_capacity", self.check_int("ring_capacity", ring_capacity, minimum=0))

    def check_context_fields(self, context: Any) -> None:
        """What a context holds besides its tensors: its fields, launch tag, hash mode and real-KV
        sources (checked once when this layer's frozen VerifyOrWriteContext is built, else at every launch)."""
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
            if type(src) is self.frozen_source and src.tensor.data_ptr():
                t = src.tensor
                reach = self.real_kv_layout_reach(src.num_bytes_per_token, src.page_size, (
                    src.token_stride_bytes, src.num_heads, src.head_stride_bytes, src.chunk_bytes,
                    src.chunk_stride_bytes))[2] + (t.shape[0] - 1) * t.stride(0) * t.element_size()
                if t.shape[0] and reach > self.extent(t):
                    inputs.append((t.data_ptr(), t.data_ptr() + reach, f"real_kv_sources[{i}].tensor", False))
        outputs = spans({name: getattr(context, name, None) for name in (
            "violation_ring", "violation_write_index", "slot_run_counter", "kernel_run_counter",
            "violation_reason_counts")}, True)
        buf = {"canary_buf": context.canary_buf}
        self.check_spans(inputs + spans(buf, False) + outputs)
        self.check_spans(inputs + spans(buf, True))

    def check_plan_class(self, plan: Any, cls: str) -> None:
        """A VerifyPlan or WritePlan (of this schema): every field its class has."""
        if type(plan) is self.frozen_plans.get(cls):
            return
        for attr in self.plan_classes[cls]:
            if not hasattr(plan, attr):
                of = " of this schema" if cls == "VerifyPlan" else ""
                raise TypeError(f"{self.prefix}plan must be a {cls}{of} (missing {attr}), got {type(plan).__name__}")

    def check_context_tensors(self, operation: str, a: dict, read: Optional[list]) -> tuple:
        """A write's or verify's tensors (its rules), then what the rules cannot check of its context."""
        sizes, spans = self.check_tensors(operation, a)
        context = a["context"]
        frozen = type(context) is self.frozen_context
        buf = context.canary_buf
        self.check_slot_stride(buf.shape[1], buf.shape)
        self.check_fits("violation_ring capacity", sizes["ring"], argument="ring_capacity")
        self.check_real_kv_sources(context.real_kv_sources, device=buf.device, mode=context.real_kv_hash_mode,
                                   frozen=frozen, spans=spans, read=read)
        if not frozen:
            self.check_context_disjoint(context)
        return a, spans

    def check_columns(self, sizes: dict) -> None:
        if sizes["cols"] == 0:
            # A request's seed is its last prefix column: a table without columns has none to read.
            raise ValueError(f"{self.prefix}req_to_token must have at least 1 column (one per context position), "
                             f"got shape {(sizes['rows'], 0)}")

    def check_requests(self, sizes: dict, write_capacity_of: str) -> None:
        if sizes["bs"] > sizes["wcap"]:
            raise ValueError(f"{self.prefix}req_pool_indices holds {sizes['bs']} requests but {write_capacity_of} is "
                             f"{sizes['wcap']}")

    def _size_checks(self) -> dict:
        """{operation: {size: check(sizes)}}: what is checked of a size as soon as its tensor passed."""
        def capacity(size, message, name="", argument=""):
            return lambda sizes: self.check_capacity(name, sizes[size], message, argument)
        verify_cap = capacity("cap", "verify_capacity", "plan.verify_slot_indices capacity", "verify_capacity")
        write_cap = capacity("wcap", "write_capacity", "plan.write_seed_slot_indices capacity", "write_req_capacity")
        return {
            "write": {"wcap": write_cap},
            "verify": {"cap": verify_cap},
            "plan": {"cols": self.check_columns, "cap": verify_cap, "wcap": write_cap,
                     "bs": lambda sizes: self.check_requests(sizes, "write_plan_out.write_req_capacity")},
            "plan_offsets": {"cols": self.check_columns, "wcap": capacity("wcap", "write_capacity"),
                             "bs": lambda sizes: self.check_requests(
                                 sizes, "the write request capacity (out_write_seed_slot_indices length)")},
            "plan_entries": {"cols": self.check_columns, "cap": capacity("cap", "verify_capacity")},
        }

    def mapping(self, kind: str, given: Optional[Mapping], names: tuple) -> dict:
        """A {field name: tensor} mapping with exactly `names` as keys ({} / None when there are none);
        its tensors are checked by the operation's rules."""
        given = {} if given is None else given
        if type(given) is not dict and not isinstance(given, Mapping):  # a dict is the usual case
            raise TypeError(f"{self.prefix}{kind} must be a dict of field name -> tensor, got {type(given).__name__}")
        if given.keys() != self.key_sets[names]:
            want = ", ".join(names) if names else "no fields (this schema declares none)"
            raise ValueError(f"{self.prefix}{kind} must have exactly the keys [{want}], got [{', '.join(map(str, given))}]")
        return {name: given[name] for name in names}

    # -- per launch: each returns the backend operation's keyword arguments, normalised ----------------
    def check(self, operation, arguments: dict, read: Optional[list] = None) -> dict:
        """Validate `operation` (an object of kv_canary/launch/operations.py) over a dict of its keywords;
        returns the backend operation's keyword arguments. The keywords get their defaults from the
        generated table (kernel_abi.OPERATIONS[...].arguments: SGLang's names and defaults), then the
        operation makes its own checks (`operation.check`). `read` (write, verify) receives what the
        binding takes of the real-KV sources (the kernels' real-KV block). Last of every operation's checks: no
        input shares memory with an output."""
        a, spans = operation.check(self, self.operations[operation.name][3](**arguments), read)
        self.check_spans(spans)
        return a

    # -- the plan and its two stages (SGLang dtypes: req_to_token and the expected-token pool int32) ----
    def check_plan_scalars(self, a: dict) -> None:
        """The window, the offset, the expected-token pool's pairing and the input-field mappings."""
        # A window <= 0 is full attention (SGLang's rule). A LUT, when given, translates every slot with
        # or without a window (docs/semantics.md §5.3); only a window needs one.
        window = self.check_fits("swa_window_size", self.check_int("swa_window_size", a["swa_window_size"]))
        if window > 0 and a["full_to_swa_index_mapping"] is None:
            raise ValueError(f"{self.prefix}full_to_swa_index_mapping is required when swa_window_size > 0, got None")
        if "kv_token_id_vs_position_offset" in a:
            self.check_fits("kv_token_id_vs_position_offset",
                            self.check_int("kv_token_id_vs_position_offset", a["kv_token_id_vs_position_offset"]))
        # The expected-token pool's valid lengths are ignored without a pool, as SGLang does (its
        # runtime passes them on every forward, pool or not: docs/sglang-compat.md).
        if a.get("req_to_verify_expected_tokens") is None:
            if "req_to_verify_expected_tokens_valid_lens" in a:
                a["req_to_verify_expected_tokens_valid_lens"] = None
        elif a["req_to_verify_expected_tokens_valid_lens"] is None:
            raise ValueError(f"{self.prefix}req_to_verify_expected_tokens and req_to_verify_expected_tokens_valid_lens "
                             f"must be given together, got only req_to_verify_expected_tokens")
        for kind in ("extra_request_values", "out_extra_verify_expected"):
            if kind in a:
                a[kind] = self.mapping(kind, a[kind], self.per_request_fields)

    def check_plan_sizes(self, a: dict, sizes: dict, scratch: str = "", *, entries: bool = True) -> None:
        """The scratch (argument `scratch`, if any) holds bs + 1 offsets, and the verify entries' total
        (at most bs x columns) is summed in 64 bits."""
        bs = sizes["bs"]
        if scratch and a[scratch].shape[0] < bs + 1:
            raise ValueError(f"{self.prefix}{scratch} must hold at least bs + 1 = {bs + 1} int64 entries (bs = "
                             f"req_pool_indices length), got shape {tuple(a[scratch].shape)}")
        if entries:
            self.check_extent("the verify plan", bs, "requests", sizes["cols"], "req_to_token columns",
                              unit="entries at most")

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
