"""The one binder: a generated tree's kernel ABI (generated/kernel_abi.py) turned into launch values.

A generated tree describes every kernel parameter once, as typed data: its name, its C type and where
its value comes from (a value source, below), a path over the arguments of the operation that launches
the kernel. The same description renders the CUDA signatures and the emulation and cpu launchers
(codegen/kernel_abi.py), so the three cannot disagree. This module is the vocabulary the generated
table is written in, and the binder that turns a kernel's table into its `bind` function once per
(tree, kernel), on first use: like Triton's launcher, which builds its binder from a kernel's
signature at run time, it writes the function's Python source from the sources and compiles it, so a
launch runs straight-line attribute reads with no per-parameter interpretation. The same is done for
an operation's tensors (what validation checks, in rule order), its keywords (defaults filled in) and
the whole plan's two stages.

A path is `argument[.attribute ...][[key]]`: an argument of the operation (a key of its validated
arguments), the attributes read from it, and for an input-field mapping the field's key
("context.canary_buf", "plan.verify_slot_indices", "extra_inputs[lang]").
"""
from __future__ import annotations

import itertools
import keyword
import linecache
import operator
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import Callable, NamedTuple, Optional, Union


# -- the value sources ----------------------------------------------------------------------------
@dataclass(frozen=True)
class Ptr:
    """A tensor's data pointer. `optional`: None, or an attribute the object does not have, passes 0
    (NULL); `when`: the flag argument that enables the tensor (0 while the flag is false)."""
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
    """`stride(dim)` of a tensor, in elements (0 for None when `optional`)."""
    path: str
    dim: int
    optional: bool = False


@dataclass(frozen=True)
class Int:
    """An integer argument. `checked`: refused here unless it fits the parameter's C type (otherwise
    validation already refused every value outside it: ARGUMENT_KINDS)."""
    path: str
    checked: bool = False


@dataclass(frozen=True)
class KvTensor:
    """What a real-KV parameter reads of its source's tensor: "ptr" (its data pointer),
    "row_stride_bytes" (stride(0) in bytes) or "rows" (shape[0])."""
    what: str


@dataclass(frozen=True)
class KvField:
    """A RealKvSource field. A source object without the field (SGLang's own) passes `default`, or
    with `fallback` the value of that field instead (also when the field is 0 or None); with neither,
    every source has the field."""
    name: str
    default: Optional[int] = None
    fallback: str = ""


@dataclass(frozen=True)
class RealKv:
    """The real-KV block: for each source i < `sources` of the RealKvSource list at `path`, the
    parameters `<name>_<i>` of `per_source` ((name, C type, KvTensor or KvField), an absent source
    passing zeros), then `count` = (name, C type): how many sources there are."""
    path: str
    sources: int
    per_source: tuple
    count: tuple


Source = Union[Ptr, Size, Stride, Int, RealKv]


class Param(NamedTuple):
    """One kernel parameter in ABI order; `kind` says how its value crosses into C ("ptr", "i64", "i32")."""
    name: str
    ctype: str
    kind: str
    source: Source


# C integer types of the scalar parameters: their kind and width in bits (a pointer's kind is "ptr").
C_INTS = {"long long": ("i64", 64), "int": ("i32", 32)}
# What a real-KV parameter reads of its source's tensor: from the tensor `t`, and from what validation
# read of it (`read[i]` = (data_ptr(), stride(0), element_size(), shape[0])).
_KV_TENSOR = {
    "ptr": ("t.data_ptr()", "ptr"),
    "row_stride_bytes": ("t.stride(0) * t.element_size()", "stride0 * element_size"),
    "rows": ("t.shape[0]", "rows"),
}


def kind_of(ctype: str) -> str:
    if ctype.endswith("*"):
        return "ptr"
    if ctype not in C_INTS:
        raise ValueError(f"kv-canary: the binder cannot pass C type {ctype!r}; expected a pointer or one of "
                         f"{sorted(C_INTS)}")
    return C_INTS[ctype][0]


def _ptr(tensor) -> int:
    return 0 if tensor is None else tensor.data_ptr()


def _int(kernel: str, param: str, ctype: str, value) -> int:
    """A scalar argument, refused (never truncated) when it does not fit its C type."""
    if type(value) is not int:  # an enum member, a numpy integer: its int value (a float is refused)
        value = operator.index(value)
    bits = C_INTS[ctype][1]
    lo, hi = -(1 << (bits - 1)), (1 << (bits - 1)) - 1
    if not lo <= value <= hi:
        raise ValueError(f"kv-canary: kernel {kernel} parameter {param} = {value} does not fit its C type "
                         f"{ctype} [{lo}, {hi}]")
    return value


# -- paths --------------------------------------------------------------------------------------------
class _Path(NamedTuple):
    root: str
    attrs: tuple
    key: Optional[str]


def _name(part: str, path: str) -> str:
    if not part.isidentifier() or keyword.iskeyword(part):
        raise ValueError(f"kv-canary: kernel ABI path {path!r}: {part!r} is not a Python name")
    return part


def parse_path(path: str) -> _Path:
    body, key = path, None
    if path.endswith("]"):
        body, _, key = path[:-1].partition("[")
        _name(key, path)
    root, *attrs = body.split(".")
    return _Path(_name(root, path), tuple(_name(a, path) for a in attrs), key)


def _join(p: _Path) -> str:
    return ".".join((p.root, *p.attrs)) + (f"[{p.key}]" if p.key is not None else "")


def _expr(path: str, optional: bool = False) -> str:
    """The Python expression reading `path` over local variables named after its arguments;
    `optional`: an attribute the object does not have reads as None."""
    p = parse_path(path)
    out = p.root
    for i, attr in enumerate(p.attrs):
        last = i == len(p.attrs) - 1 and p.key is None
        out = f"getattr({out}, {attr!r}, None)" if optional and last else f"{out}.{attr}"
    return out if p.key is None else f"{out}[{p.key!r}]"


def resolve(path: str, args: dict):
    """The value at `path` over an operation's arguments (where speed does not matter)."""
    p = parse_path(path)
    value = args[p.root]
    for attr in p.attrs:
        value = getattr(value, attr)
    return value if p.key is None else value[p.key]


_compiled = itertools.count(1)


def _compile(source: str, name: str, what: str, namespace: dict) -> Callable:
    """`source` defining function `name`, compiled; its text is kept for tracebacks under `what`."""
    filename = f"<kv-canary binder #{next(_compiled)}: {what}>"
    linecache.cache[filename] = (len(source), None, source.splitlines(True), filename)
    exec(compile(source, filename, "exec"), namespace)  # our own text, of checked names only
    return namespace[name]


def _roots(paths) -> tuple[str, ...]:
    return tuple(dict.fromkeys(parse_path(p).root for p in paths))


# -- a kernel's binding ---------------------------------------------------------------------------------
def _value(kernel: str, param: str, ctype: str, src: Source) -> str:
    """The expression of one parameter's value."""
    if isinstance(src, Ptr):
        if src.when:
            return f"_ptr({_expr(src.path)} if {_expr(src.when)} else None)"
        return f"_ptr({_expr(src.path, True)})" if src.optional else f"{_expr(src.path)}.data_ptr()"
    if isinstance(src, (Size, Stride)):
        e = _expr(src.path, src.optional)
        read = f"{e}.shape[{int(src.dim)}]" if isinstance(src, Size) else f"{e}.stride({int(src.dim)})"
        value = f"({read} if {e} is not None else 0)" if src.optional else read
        # a size or a stride fits int64 by construction; a narrower parameter checks it
        return value if kind_of(ctype) == "i64" else f"_int({kernel!r}, {param!r}, {ctype!r}, {value})"
    if isinstance(src, Int):
        e = _expr(src.path)
        return f"_int({kernel!r}, {param!r}, {ctype!r}, {e})" if src.checked else e
    raise ValueError(f"kv-canary: kernel {kernel} parameter {param}: unknown value source {src!r}")


def _paths(src) -> tuple[str, ...]:
    return (src.path, src.when) if isinstance(src, Ptr) and src.when else (src.path,)


def _real_kv_function(block: RealKv, what: str) -> Callable:
    """real_kv(sources, read) -> the block's values: every source's parameters, zeros for the absent
    ones, then the count. `read`: per source what validation read of its tensor (None: read here)."""
    def row(side: int) -> str:
        values = []
        for name, _, src in block.per_source:
            if isinstance(src, KvTensor):
                values.append(_KV_TENSOR[src.what][side])
            elif src.fallback:
                values.append(f"getattr(s, {_name(src.name, name)!r}, None) or s.{_name(src.fallback, name)}")
            elif src.default is not None:
                values.append(f"getattr(s, {_name(src.name, name)!r}, {int(src.default)})")
            else:
                values.append(f"s.{_name(src.name, name)}")
        return ", ".join(values)
    n = int(block.sources)
    source = (f"def real_kv(sources, read):\n"
              f"    out = ()\n"
              f"    for i, s in enumerate(sources[:{n}]):  # validated: never more\n"
              f"        if read is None:\n"
              f"            t = s.tensor\n"
              f"            out += ({row(0)},)\n"
              f"        else:\n"
              f"            ptr, stride0, element_size, rows = read[i]\n"
              f"            out += ({row(1)},)\n"
              f"    return out + {(0,) * len(block.per_source)!r} * ({n} - len(sources)) + (len(sources),)\n")
    return _compile(source, "real_kv", what, {})


def _expand(table: tuple) -> tuple[Param, ...]:
    out = []
    for entry in table:
        if isinstance(entry, RealKv):
            for i in range(entry.sources):
                out.extend(Param(f"{name}_{i}", ctype, kind_of(ctype), entry) for name, ctype, _ in entry.per_source)
            out.append(Param(entry.count[0], entry.count[1], kind_of(entry.count[1]), entry))
        else:
            name, ctype, src = entry
            out.append(Param(name, ctype, kind_of(ctype), src))
    return tuple(out)


def _tuple_items(kernel: str, table: tuple) -> list[str]:
    """The items of a kernel's value tuple: one per parameter, the real-KV block as one splice."""
    return ["*_real_kv(" + _expr(e.path) + ", read)" if isinstance(e, RealKv) else _value(kernel, e[0], e[1], e[2])
            for e in table]


@dataclass(frozen=True)
class KernelAbi:
    """One kernel of a generated tree: its entry points, launch shape and parameters. `table`: the
    parameters as the tree lists them ((name, C type, source), the real-KV block as one RealKv);
    `params`: every parameter in ABI order; `bind(arguments[, read])`: the launch's values in ABI
    order as Python ints (`read`, with a real-KV block: what validation read of its sources)."""
    name: str
    operation: str                  # the operation that launches it
    source: str                     # relative to the generated tree
    shape: str                      # launch shape (kernels.yaml)
    threads: int
    blocks_per_sm: int              # persistent only
    blocks: int                     # fixed_grid only
    warp_reduction: bool
    variants: tuple                 # ((entry point, ((flag, value), ...)), ...)
    table: tuple
    params: tuple = field(init=False, repr=False, compare=False)
    kinds: tuple = field(init=False, repr=False, compare=False)   # "ptr", "i64" or "i32" per parameter
    real_kv: Optional[RealKv] = field(init=False, repr=False, compare=False)  # its real-KV block, if any

    def __post_init__(self):
        blocks = [e for e in self.table if isinstance(e, RealKv)]
        if len(blocks) > 1:
            raise ValueError(f"kv-canary: kernel {self.name} lists {len(blocks)} real-KV blocks; a kernel takes at "
                             f"most one")
        params = _expand(self.table)
        object.__setattr__(self, "params", params)
        object.__setattr__(self, "kinds", tuple(p.kind for p in params))
        object.__setattr__(self, "real_kv", blocks[0] if blocks else None)

    def entry_point(self, **flags: bool) -> str:
        """The entry point compiled for exactly these specialisation flags."""
        wanted = tuple(sorted(flags.items()))
        for symbol, values in self.variants:
            if tuple(sorted(values)) == wanted:
                return symbol
        raise ValueError(f"kv-canary: kernel {self.name} has no variant for flags {dict(wanted)}; "
                         f"variants are {[dict(v) for _, v in self.variants]}")

    @cached_property
    def bind(self) -> Callable:
        """bind(arguments[, read]) -> the values in ABI order, compiled from the table on first use."""
        namespace: dict = {"_ptr": _ptr, "_int": _int}
        paths = [p for e in self.table for p in ((e.path,) if isinstance(e, RealKv) else _paths(e[2]))]
        if self.real_kv is not None:
            namespace["_real_kv"] = _real_kv_function(self.real_kv, f"{self.name} real-KV block")
        lines = [f"def bind(a{', read' if self.real_kv is not None else ''}):"]
        lines += [f"    {root} = a[{root!r}]" for root in _roots(paths)]
        lines += ["    return (", *(f"        {item}," for item in _tuple_items(self.name, self.table)), "    )"]
        return _compile("\n".join(lines) + "\n", "bind", f"bind {self.name}", namespace)



def kernel_for_operation(kernels: dict, operation: str) -> KernelAbi:
    """The (first) kernel of `kernels` that runs `operation`."""
    for kernel in kernels.values():
        if kernel.operation == operation:
            return kernel
    raise ValueError(f"kv-canary: kernels.yaml declares no kernel for operation '{operation}' "
                     f"(kernels: {sorted(kernels)})")


# -- an operation's tensors and keywords -----------------------------------------------------------------
class OperationRules:
    """The tensors of one operation and what each must be (kv_canary/launch/validation.py checks them).

    `tensor_rules[i]` = (path, rule): the tensor's path and its rule, `rules[i]` = (name, dtype, dims,
    role, optional, contiguous, align, align_words, overlap name). dims: per dimension an int, None
    (any size), a symbol that its first rule binds ("n") or a symbol plus one ("n+1"). Every tensor is
    on the device of the first; no "input" may share memory with an "output", nor two "output"s with
    each other. `tensors(arguments)`: the tensors in rule order; `arguments(**keywords)`: the
    operation's keywords as a dict, `defaults` filled in (both compiled on first use).
    """

    def __init__(self, *, name: str, device_of: str, keywords: tuple, defaults: dict, tensor_rules: tuple):
        self.name, self.device_of, self.keywords, self.defaults = name, device_of, keywords, defaults
        self.paths = tuple(path for path, _ in tensor_rules)
        self.rules = tuple(rule for _, rule in tensor_rules)

    @cached_property
    def tensors(self) -> Callable:
        lines = ["def tensors(a):", *(f"    {root} = a[{root!r}]" for root in _roots(self.paths)), "    return ("]
        lines += [f"        {_expr(path, rule[4])}," for path, rule in zip(self.paths, self.rules)]
        return _compile("\n".join(lines + ["    )"]) + "\n", "tensors", f"tensors of {self.name}", {})

    @cached_property
    def arguments(self) -> Callable:
        names = [_name(k, self.name) for k in self.keywords]
        decls = [f"{k}=_defaults[{k!r}]" if k in self.defaults else k for k in names]
        source = (f"def {_name(self.name, self.name)}(*, {', '.join(decls)}):\n"
                  f"    return {{{', '.join(f'{k!r}: {k}' for k in names)}}}\n")
        return _compile(source, self.name, f"keywords of {self.name}", {"_defaults": dict(self.defaults)})


# -- the whole plan's two stages ------------------------------------------------------------------------
SCRATCH = "scratch"  # the root of a stage value that is the scratch between the stages


class PlanStages:
    """The whole plan runs its two stages (kv_canary/launch/operations.py Plan) over a scratch of verify
    offsets that the first writes and the second reads. `stages`: per stage operation, each of its
    keywords' value: a path over the plan's arguments (or "scratch"), or for an input-field mapping
    {field: path}. `bind(plan, scratch)`: both stage kernels' values, without the stages' dicts."""

    def __init__(self, kernels: dict, stages: dict):
        self.kernels, self.stages = kernels, stages

    def args(self, plan: dict, scratch) -> tuple[dict, ...]:
        """Each stage's keywords over the plan's validated arguments (SGLang's keywords of
        launch_plan_offsets_kernel and launch_plan_entries_kernel)."""
        env = {**plan, SCRATCH: scratch}
        return tuple({k: {f: resolve(p, env) for f, p in v.items()} if isinstance(v, dict) else resolve(v, env)
                      for k, v in values.items()} for values in self.stages.values())

    def _over_plan(self, stage: str, src: Source) -> Source:
        """A stage kernel parameter's source as a path over the plan's arguments."""
        values = self.stages[stage]

        def compose(path: str) -> str:
            p = parse_path(path)
            value = values[p.root]
            if isinstance(value, dict):
                return value[p.key]
            base = parse_path(value)
            return _join(_Path(base.root, base.attrs + p.attrs, p.key))
        if isinstance(src, Ptr) and src.when:
            return replace(src, path=compose(src.path), when=compose(src.when))
        return replace(src, path=compose(src.path))

    @cached_property
    def bind(self) -> Callable:
        stages = []
        for stage in self.stages:
            kernel = kernel_for_operation(self.kernels, stage)
            if kernel.real_kv is not None:
                raise ValueError(f"kv-canary: plan stage kernel {kernel.name} cannot take a real-KV block")
            stages.append([(kernel.name, name, ctype, self._over_plan(stage, src)) for name, ctype, src in kernel.table])
        head = 0  # the parameters both stages begin with alike are read once
        while (head < min(map(len, stages)) and stages[0][head][1:] == stages[-1][head][1:]
               and not (isinstance(stages[0][head][3], Int) and stages[0][head][3].checked)):
            head += 1
        paths = [p for items in stages for *_, src in items for p in _paths(src)]
        lines = ["def bind(a, scratch):", *(f"    {r} = a[{r!r}]" for r in _roots(paths) if r != SCRATCH)]
        lines += ["    head = (", *(f"        {_value(*item)}," for item in stages[0][:head]), "    )"]
        for i, items in enumerate(stages):
            lines += [f"    stage{i} = (", "        *head,", *(f"        {_value(*item)}," for item in items[head:]), "    )"]
        lines.append(f"    return {', '.join(f'stage{i}' for i in range(len(stages)))}")
        return _compile("\n".join(lines) + "\n", "bind", "bind the plan's stages", {"_ptr": _ptr, "_int": _int})
