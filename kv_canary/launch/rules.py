"""What a launch's values must be, and the generic checks that hold them to it (docs/semantics.md §7).

- Tensor rules. Every tensor of an operation has a rule in the tree's generated kernel ABI
  (generated/kernel_abi.py OPERATIONS[...].rules, rendered from the operation table
  codegen/operations.py): dtype, dims, role, alignment, the name it is reported under when it shares
  memory. `tensor_rules` turns those positional tuples into named `TensorRule` records once per
  tree, with what each rule's check needs precomputed; `Rules.check_tensors` holds an operation's
  tensors to them, reading each tensor's attributes once, and hands a tensor that breaks its rule
  to `refuse`, which names the first thing that is wrong (`check_tensor`, one check after the other).
  `check_spans`: no input shares memory with an output.
- Scalar helpers: ints (numpy integer scalars too, never bools), bools, enum members, devices, and
  integers within the C integer of the kernels that take them (the kinds from the kernel ABI's
  ARGUMENT_KINDS and RANGES), with the argument's own name.

Nothing here knows an operation or the schema's data classes: the operations' own checks are in
kv_canary/launch/operations.py, those of the launch data classes in kv_canary/launch/validation.py.
(One module for both kinds of generic check: a launch crosses it, and the launch path is kept to six
project files, tests/test_launch_path.py.) Everything is read from shapes, dtypes, data pointers and
Python values: no device value, so a check never synchronises a GPU.
"""
from __future__ import annotations

import dataclasses
import operator
from typing import Any, Callable, Mapping, NamedTuple, Optional

import torch

_TENSOR = torch.Tensor
_DTYPES = {"uint8": torch.uint8, "int32": torch.int32, "int64": torch.int64}

# What one dimension of a rule does (Dim.kind).
ANY, EQUALS, BINDS, MATCHES = range(4)
# What a rule's shape check is as a whole (TensorRule.shape_kind): every size fixed, any other rank-N
# check, or, for a one-dimensional rule, its dimension's kind (BINDS, MATCHES, ANY).
FIXED, GENERAL = 4, 5


class Dim(NamedTuple):
    """One dimension of a tensor rule."""
    kind: int                # ANY, EQUALS (a fixed size), BINDS (the first rule naming a size), MATCHES
    value: Any               # EQUALS: the size; BINDS, MATCHES: the size's symbol ("n"); ANY: None
    plus: int = 0            # MATCHES: the offset ("cap+1" matches cap + 1)


@dataclasses.dataclass(frozen=True, slots=True)
class TensorRule:
    """One tensor's rule, ready to check: the generated rule's fields by name, and what the check of
    every launch reads precomputed."""
    name: str                      # what a refusal calls it ("plan.write_offsets")
    dtype: torch.dtype
    dims: tuple                    # of Dim
    output: bool                   # the launch writes it
    optional: bool                 # None is allowed
    contiguous: bool
    align: int                     # bytes its address must be a multiple of beyond its elements' (0: none)
    words: str                     # what the kernels read it as, for the alignment text ("8-byte record words")
    overlap: str                   # the name it is reported under when it shares memory
    # precomputed
    rank: int
    shape_kind: int                # FIXED, GENERAL, or its one dimension's BINDS / MATCHES / ANY
    fixed: Optional[torch.Size]    # FIXED: the shape
    symbol: Optional[str]          # one dimension that binds or matches: its symbol
    plus: int                      # ... and its offset
    binds: tuple                   # the symbols this rule binds
    element_size: int
    align_bytes: int               # the address must be a multiple of it (align, else the element size)
    after: Optional[tuple]         # the operation's checks of the sizes it binds (run once it passed), or None

    def match(self, shape, sizes: dict) -> bool:
        """`shape` against a rule of any rank, binding the sizes its symbols name first."""
        if len(shape) != self.rank:
            return False
        for (kind, value, plus), got in zip(self.dims, shape):
            if kind == EQUALS:
                if got != value:
                    return False
            elif kind == MATCHES:
                if got != sizes[value] + plus:
                    return False
            elif kind == BINDS:
                sizes[value] = got
        return True


def tensor_rules(generated: tuple, size_checks: Mapping[str, Callable]) -> tuple:
    """An operation's generated rules (kernel_abi.OPERATIONS[...].rules, positional tuples: the one
    place their layout is read) as TensorRule records. `size_checks`: {size symbol: check(sizes)}, the
    operation's checks of a size, run as soon as the tensor binding it passed."""
    bound: set = set()
    out = []
    for name, dtype, dims, role, optional, contiguous, align, words, overlap in generated:
        parsed = []
        for d in dims:
            if d is None:
                parsed.append(Dim(ANY, None))
            elif isinstance(d, int):
                parsed.append(Dim(EQUALS, d))
            else:
                symbol, _, plus = d.partition("+")
                if plus or symbol in bound:
                    parsed.append(Dim(MATCHES, symbol, int(plus or 0)))
                else:
                    bound.add(symbol)
                    parsed.append(Dim(BINDS, symbol))
        binds = tuple(d.value for d in parsed if d.kind == BINDS)
        torch_dtype = _DTYPES[dtype]
        fixed = symbol = None
        plus = 0
        if all(d.kind == EQUALS for d in parsed):
            shape_kind, fixed = FIXED, torch.Size(d.value for d in parsed)
        elif len(parsed) == 1:
            shape_kind, symbol, plus = parsed[0]  # one dimension: BINDS, MATCHES or ANY
        else:
            shape_kind = GENERAL
        out.append(TensorRule(
            name=name, dtype=torch_dtype, dims=tuple(parsed), output=role == "output", optional=optional,
            contiguous=contiguous, align=align, words=words, overlap=overlap, rank=len(parsed),
            shape_kind=shape_kind, fixed=fixed, symbol=symbol, plus=plus, binds=binds,
            element_size=torch_dtype.itemsize, align_bytes=align or torch_dtype.itemsize,
            after=tuple(size_checks[s] for s in binds if s in size_checks) or None))
    return tuple(out)


class FieldNames(NamedTuple):
    """The keys a {field name: tensor} mapping must have (Rules.mapping)."""
    names: tuple                   # in the schema's order
    keys: frozenset                # the same, as a set (compared with the mapping's keys)


@dataclasses.dataclass(frozen=True, slots=True)
class OperationTensors:
    """An operation's tensors and their rules in one tree."""
    rules: tuple                   # of TensorRule, in the order `tensors` returns them
    tensors: Callable              # the operation's arguments (a dict) -> its tensors (generated)
    device_of: str                 # the argument whose device every tensor must share (the first)


def operation_tensors(generated, size_checks: Mapping[str, Callable]) -> OperationTensors:
    """An operation's entry of the generated kernel ABI (kernel_abi.OPERATIONS[name]) ready to check."""
    return OperationTensors(tensor_rules(generated.rules, size_checks), generated.tensors, generated.device_of)


def bound_text(value: int) -> str:
    """2147483647 as '2**31-1 = 2147483647' (the C limits read better as powers of two)."""
    if value > 0 and (value + 1) & value == 0:
        return f"2**{(value + 1).bit_length() - 1}-1 = {value}"
    if value < 0 and (-value) & (-value - 1) == 0:
        return f"-2**{(-value).bit_length() - 1} = {value}"
    return str(value)


class Rules:
    """The generic checks of one tree (`layout`: its generated layout module, for the message prefix
    and the §7 texts; `abi`: its generated kernel ABI, for the C kinds of the kernels' arguments)."""

    def __init__(self, layout, abi):
        self.layout, self.abi = layout, abi
        self.prefix = layout.MESSAGE_PREFIX
        self.ranges = {argument: abi.RANGES[kind] for argument, kind in abi.ARGUMENT_KINDS.items()}

    def message(self, key: str, **values: Any) -> str:
        """The full §7 text of `key` with its run-time values filled in."""
        return self.prefix + self.layout.MESSAGES[key].format(**values)

    def fail(self, key: str, **values: Any) -> ValueError:
        return ValueError(self.message(key, **values))

    # -- tensors against their rules ------------------------------------------------------------------
    def check_tensors(self, op: OperationTensors, args: dict) -> tuple[dict, list]:
        """Every tensor of an operation against its rule; returns the sizes the rules bound
        ({"n": tokens, "cap": capacity, ...}) and the (first byte, end, name, output?) spans of its
        tensors (for check_spans). One read of each attribute per tensor; a tensor that breaks its
        rule goes to refuse, which raises with the first thing that is wrong. A rule's size checks
        (TensorRule.after) run as soon as it passed."""
        sizes: dict = {}
        spans: list = []
        ts = op.tensors(args)
        first = ts[0]  # the device_of tensor: every other one must share its device
        dev = first.device if type(first) is _TENSOR and not first.is_meta else None
        cpu = dev is not None and first.is_cpu  # is_cpu reads faster than a device object (or its type)
        for rule, t in zip(op.rules, ts):
            if t is None and rule.optional:
                continue
            ok = (type(t) is _TENSOR and t.dtype is rule.dtype and (t.is_cpu if cpu else t.device == dev)
                  and t.is_contiguous())
            if ok:
                shape = t.shape
                kind = rule.shape_kind
                if kind == FIXED:
                    ok = shape == rule.fixed
                elif len(shape) != 1:
                    ok = kind == GENERAL and rule.match(shape, sizes)
                elif kind == BINDS:
                    sizes[rule.symbol] = shape[0]
                elif kind == MATCHES:
                    ok = shape[0] == sizes[rule.symbol] + rule.plus
                elif kind != ANY:
                    ok = rule.match(shape, sizes)  # a rule of another rank: refused
            if ok:
                ptr, n = t.data_ptr(), t.nbytes
                ok = (not ptr % rule.align_bytes
                      and t.storage_offset() * rule.element_size + n <= t.untyped_storage().nbytes())
            if not ok:
                self.refuse(op, ts, rule, t, sizes, dev)  # raises, but for a valid non-contiguous tensor
                for (kind, value, _), got in zip(rule.dims, t.shape):
                    if kind == BINDS:
                        sizes[value] = got
                if dev is None:
                    dev = t.device
                    cpu = dev.type == "cpu"
                ptr, n = t.data_ptr(), self.extent(t)
            if n and ptr:
                spans.append((ptr, ptr + n, rule.overlap, rule.output))
            if rule.after is not None:
                for check in rule.after:
                    check(sizes)
        return sizes, spans

    def refuse(self, op: OperationTensors, ts: tuple, rule: TensorRule, t: Any, sizes: dict, device) -> None:
        """Raise the text of the first thing `t` breaks of `rule` (the checks one by one); a size
        that must match another argument's names that argument too (`ts`: the operation's tensors)."""
        shape = tuple(value if kind == EQUALS else sizes[value] + plus if kind == MATCHES else None
                      for kind, value, plus in rule.dims)
        dims = dict(ndim=rule.rank) if all(d is None for d in shape) else dict(shape=shape)
        binders = self._binders(op, ts, rule)
        matched = []
        for dim, (kind, value, plus) in enumerate(rule.dims):
            if kind == MATCHES and binders.get(value) is not None:
                other, other_dim, other_rank = binders[value]
                size = f"the length of {other}" if other_rank == 1 else f"dimension {other_dim} of {other}"
                mine = "its length" if rule.rank == 1 else f"dimension {dim}"
                matched.append(f"{mine} must equal {size} ({sizes[value]}){f' + {plus}' if plus else ''}")
        try:
            self.check_tensor(rule.name, t, dtype=rule.dtype, device=device, device_of=op.device_of,
                              contiguous=rule.contiguous, **dims)
        except ValueError as e:
            if matched and " must have shape " in str(e):
                raise ValueError(f"{e}: {'; '.join(matched)}") from None
            raise
        if rule.align:
            self.check_aligned(rule.name, t, rule.align, rule.words)

    @staticmethod
    def _binders(op: OperationTensors, ts: tuple, rule: TensorRule) -> dict:
        """symbol -> (argument, dimension, its rank) that bound it before `rule`: the first tensor given whose
        rule binds it (what a size mismatch is a mismatch with). Only on the refusal path."""
        found: dict = {}
        for other, t in zip(op.rules, ts):
            if other is rule:
                break
            if t is None:
                continue
            for dim, (kind, value, _) in enumerate(other.dims):
                if kind == BINDS:
                    found.setdefault(value, (other.name, dim, other.rank))
        return found

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

    # -- one tensor, one check after the other (the refusal texts) ---------------------------------------
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

    # -- scalar helpers -----------------------------------------------------------------------------------
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

    def check_bool(self, name: str, value: Any) -> bool:
        if not isinstance(value, bool):
            raise TypeError(f"{self.prefix}{name} must be a bool, got {type(value).__name__}")
        return value

    def check_fits(self, name: str, value: int, *, argument: Optional[str] = None) -> int:
        """`value` within the C integer of the kernels that takes argument `argument` (default: `name`;
        the kind comes from the generated kernel ABI, never from a table here)."""
        lo, hi = self.ranges[argument or name]
        if not lo <= value <= hi:
            kind = self.abi.ARGUMENT_KINDS[argument or name]
            side, bound = ("<=", hi) if value > hi else (">=", lo)
            raise ValueError(f"{self.prefix}{name} must be {side} {bound_text(bound)} (the kernels hold it in a C "
                             f"{self.abi.C_NAMES[kind]}), got {value}")
        return value

    def check_capacity(self, name: str, value: Any, message: str, argument: Optional[str] = None) -> int:
        """A positive int (numpy integer scalars too) that fits the C int the kernels count it in
        (`argument`: the kernel argument that takes it, default `name`; "" for a size with no C int)."""
        value = self.check_int(name, value)
        if value <= 0:
            raise self.fail(message, n=value)
        return self.check_fits(name, value, argument=argument) if argument != "" else value

    def check_extent(self, what: str, count: int, count_name: str, size: int, size_name: str,
                     unit: str = "bytes") -> None:
        """count x size within int64: the kernels compute such products (slot * stride, row * row
        stride, the plan's entry total) in signed 64-bit integers."""
        most = self.abi.RANGES["i64"][1]
        if count * size > most:
            raise ValueError(f"{self.prefix}{what} is too large: {count_name}={count} x {size_name}={size} = "
                             f"{count * size} {unit}, more than a signed 64-bit integer holds "
                             f"({bound_text(most)}); the kernels compute it in one")

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

    def mapping(self, kind: str, given: Optional[Mapping], fields: FieldNames) -> dict:
        """A {field name: tensor} mapping with exactly `fields` as keys ({} / None when there are none);
        its tensors are checked by the operation's rules."""
        given = {} if given is None else given
        if type(given) is not dict and not isinstance(given, Mapping):  # a dict is the usual case
            raise TypeError(f"{self.prefix}{kind} must be a dict of field name -> tensor, got {type(given).__name__}")
        if given.keys() != fields.keys:
            want = ", ".join(fields.names) if fields.names else "no fields (this schema declares none)"
            raise ValueError(f"{self.prefix}{kind} must have exactly the keys [{want}], got [{', '.join(map(str, given))}]")
        return {name: given[name] for name in fields.names}
