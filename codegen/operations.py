"""The operation table: every operation of the launch path described once.

One `Operation` per backend operation (write, verify, plan and its two stages, scatter). Everything
that used to list operations by hand is rendered or derived from this table:

- the kernel templates a schema may name (`KERNEL_TEMPLATES`: launch shapes and specialisations,
  what codegen/checks.py checks kernels.yaml against) and the kernel's parameters in ABI order
  (`params`: the CUDA signature, the emulation launcher and the Python binding;
  codegen/kernel_abi.py builds the parameter lists);
- where its kernel's code is: the CUDA source template (`KernelTemplateSpec.source_template`:
  KERNEL_SOURCE_TEMPLATES in codegen/outputs.py), whether kvc_cpu.h has its host loop (`cpu`: the
  cpu library's entry points) and whether host backends store its rows in entry order;
- the operation's keywords (SGLang's keyword-only arguments with their defaults, the input-field
  keywords a schema's fields make appear) and its public launch functions (`public`): data in
  generated/kernel_abi.py (`OPERATIONS`) and the public launches of codegen/launches.py
  (generated/api.py); the reference binding of generated/reference.py follows from its name;
- the per-tensor rules (dtype, dims, device, contiguity, alignment, input or output) that
  kv_canary/launch/rules.py checks at every launch, rendered as data into generated/kernel_abi.py
  (`OPERATIONS`), with the path that reaches each tensor from the operation's arguments;
- the plan data classes' fields (`verify_plan_fields`, `WRITE_PLAN_FIELDS`) and the "unknown"
  sentinel they start with, rendered for kv_canary/launch/allocation.py.
- the arguments the whole plan hands its two stages (`plan_stage_values`: generated/kernel_abi.py
  PLAN, from which kv_canary/backends/binder.py binds the plan's two kernels).

Adding an operation is one entry here, plus its device code, its source template, its operation
object and its reference function (docs/adding-a-kernel.md: five files).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

from .kernel_abi import (
    C_TYPES,
    ELEMENT_KINDS,
    KIND_RANGES,
    REAL_KV_SOURCE_PARAMS,
    Int,
    KvField,
    Param,
    plan_entries_params,
    plan_offsets_params,
    scatter_params,
    verify_params,
    write_params,
)
from .model import Kernel, Schema

# The value of an expected entry (a plan's expected tokens and fields) that is not checked, and of
# a write seed that is the chain head: docs/semantics.md §5 calls it "unknown".
UNKNOWN = -1

ROLES = ("input", "output")


@dataclass(frozen=True)
class KernelTemplateSpec:
    """What an operation's kernel accepts (launch shapes, compile-time specialisations) and where its
    code is: its CUDA source renders from `cuda/<operation>.cu.j2` over `kv_canary/csrc/kvc_<operation>.cuh`
    (one template per launch shape, `cuda/<operation>_<shape>.cu.j2`, when `source_per_shape`)."""
    shapes: tuple[str, ...]
    specializations: tuple[str, ...] = ()
    source_per_shape: bool = False
    # kv_canary/csrc/kvc_cpu.h has a host loop `kvc_cpu::<operation>` for it, called like the CUDA entry
    # point through cuda/_params.j2's `<operation>_call`: the cpu backend runs it natively. Without one,
    # the cpu library leaves the kernel out and the cpu backend runs the operation's torch reference.
    cpu: bool = False
    # A host backend's launch re-stores its violation rows in entry order (docs/semantics.md §5.2: the
    # emulation launchers' kvc::EntryOrderLog).
    entry_order: bool = False

    def source_template(self, operation: str, shape: str) -> str:
        """The Jinja template of the kernel's CUDA source (codegen/templates/), for a launch shape."""
        return f"cuda/{operation}_{shape}.cu.j2" if self.source_per_shape else f"cuda/{operation}.cu.j2"


@dataclass(frozen=True)
class PublicLaunch:
    """A public launch function running an operation (generated/api.py; its keywords are the operation's)."""
    name: str                       # SGLang's name
    doc: str                        # one line
    reference: bool = True          # also generate `<name>_torch_reference` (always the torch reference)


class _Required:
    def __repr__(self) -> str:
        return "REQUIRED"


REQUIRED = _Required()  # a keyword without a default


@dataclass(frozen=True)
class Keyword:
    """One keyword argument of an operation, in SGLang's order."""
    name: str
    default: object = REQUIRED      # its default value (None, 0), or REQUIRED
    # An input-field keyword ({field: tensor}): the Record property naming its fields, and what it
    # maps them to. It appears in a public signature only when the schema has such fields.
    fields: str = ""
    what: str = ""


@dataclass(frozen=True)
class TensorRule:
    """One tensor an operation reads or writes, and what it must be.

    `dims`: per dimension an int, None (any size), a symbol ("n": the first rule naming it binds it
    to the size it finds, the next ones must match) or a symbol plus one ("cap+1"). Every tensor is
    on the device of the operation's first tensor, is checked against its storage, and is an input
    or an output: no input may share memory with an output of the same launch.
    """
    name: str                       # as messages name it
    path: str                       # over the operation's arguments: `argument[.attribute ...][[key]]`
    dtype: str                      # torch dtype name
    dims: tuple
    role: str                       # one of ROLES
    optional: bool = False          # None is allowed (and not checked)
    contiguous: bool = True
    align: int = 0                  # bytes the kernels read it in (0: its element size)
    align_words: str = ""           # what those words are (the alignment message)
    overlap_name: str = ""          # the name in overlap messages, when it differs from `name`

    @property
    def overlap_label(self) -> str:
        return self.overlap_name or self.name


@dataclass(frozen=True)
class DataField:
    """A tensor field of a launch data class and how allocate() fills it."""
    name: str
    dtype: str
    dims: tuple                     # as TensorRule.dims; the capacity symbol is the class's
    fill: int = 0


@dataclass(frozen=True)
class Operation:
    name: str                       # backend operation, and its checks (Validators._check_<name>)
    keywords: tuple[Keyword, ...]   # the operation's keyword arguments, in order
    device_of: str                  # the tensor whose device the others must share (its rule's name)
    tensors: Callable[[Schema], tuple[TensorRule, ...]]
    # The kernel template of the same name (None: an operation that runs other operations' kernels).
    kernel: Optional[KernelTemplateSpec] = None
    params: Optional[Callable[[Schema], tuple[Param, ...]]] = None
    # Its public launch functions (codegen/launches.py orders them: those with a torch-reference
    # variant first, SGLang's launchers, then the stage and alias launchers).
    public: tuple[PublicLaunch, ...] = ()

    @property
    def defaults(self) -> dict:
        """The keywords the runtime may leave out, with their values: an input-field mapping may be
        left out (None: no fields)."""
        return {k.name: None if k.default is REQUIRED else k.default for k in self.keywords
                if k.default is not REQUIRED or k.fields}


# -- the plan data classes -----------------------------------------------------------------------
def verify_plan_fields(schema: Schema) -> tuple[DataField, ...]:
    """VerifyPlan: int64 arrays of the capacity (expected values start unknown), the int32 scalars,
    then one expected array per input field verified per request."""
    per_request = tuple(DataField(f"verify_expected_{f.name}", "int64", ("cap",), UNKNOWN)
                        for f in schema.canary.per_request_fields)
    return (DataField("verify_slot_indices", "int64", ("cap",)),
            DataField("verify_expected_tokens", "int64", ("cap",), UNKNOWN),
            DataField("verify_expected_positions", "int64", ("cap",)),
            DataField("verify_prev_slot_indices", "int64", ("cap",)),
            DataField("verify_num_valid", "int32", (1,)),
            DataField("enable", "int32", (1,), 1),  # SGLang's default: enabled
            *per_request)


WRITE_PLAN_FIELDS = (
    DataField("write_offsets", "int64", ("cap+1",)),
    DataField("write_seed_slot_indices", "int64", ("cap",), UNKNOWN),  # unknown: the chain head
    DataField("write_num_valid_reqs", "int32", (1,)),
)


def _plan_rules(fields, arg: str, symbol: str, role: str, *, label: str) -> tuple[TensorRule, ...]:
    """A plan data class's tensors: the field that binds the capacity first, then the others in order."""
    def rule(f: DataField) -> TensorRule:
        dims = tuple(d.replace("cap", symbol) if isinstance(d, str) else d for d in f.dims)
        name = f"{label}.{f.name}"
        return TensorRule(name, f"{arg}.{f.name}", f.dtype, dims, role,
                          overlap_name="" if arg == label else f"{arg}.{f.name}")
    binder = next(f for f in fields if f.dims == ("cap",))
    return (rule(binder), *(rule(f) for f in fields if f is not binder))


def _mapping_rules(schema: Schema, keyword: str, fields: str, dims: tuple, role: str) -> tuple[TensorRule, ...]:
    return tuple(TensorRule(f"{keyword}[{f.name!r}]", f"{keyword}[{f.name}]", "int64", dims, role)
                 for f in getattr(schema.canary, fields))


# -- per-tensor rules of each operation, in the order they are checked ----------------------------
def _context_rules(schema: Schema, canary_buf_role: str) -> tuple[TensorRule, ...]:
    word = schema.canary.word_bytes
    return (
        TensorRule("canary_buf", "context.canary_buf", "uint8", ("slots", None), canary_buf_role, align=word,
                   align_words=f"{word}-byte record words"),
        TensorRule("violation_ring", "context.violation_ring", "int64", ("ring", len(schema.violation.fields)),
                   "output"),
        TensorRule("violation_write_index", "context.violation_write_index", "int32", (1,), "output"),
        TensorRule("slot_run_counter", "context.slot_run_counter", "int64", (1,), "output"),
        TensorRule("kernel_run_counter", "context.kernel_run_counter", "int64", (1,), "output"),
        TensorRule("enable_chain_position_assert", "context.enable_chain_position_assert", "int32", (1,), "input"),
        # [extension] optional per-reason totals: an SGLang-style context object has no such field.
        TensorRule("violation_reason_counts", "context.violation_reason_counts", "int64",
                   (len(schema.fail_reason.members),), "output", optional=True),
    )


def write_rules(schema: Schema) -> tuple[TensorRule, ...]:
    return (
        *_context_rules(schema, "output"),
        *_plan_rules(WRITE_PLAN_FIELDS, "plan", "wcap", "input", label="plan"),
        TensorRule("input_ids", "input_ids", "int64", ("n",), "input"),
        TensorRule("positions", "positions", "int64", ("n",), "input"),
        TensorRule("out_cache_loc", "out_cache_loc", "int64", ("n",), "input"),
        TensorRule("expected_input_tokens", "expected_input_tokens", "int64", ("n",), "input", optional=True),
        TensorRule("expected_input_positions", "expected_input_positions", "int64", ("n",), "input", optional=True),
        *_mapping_rules(schema, "extra_inputs", "input_fields", ("n",), "input"),
    )


def verify_rules(schema: Schema) -> tuple[TensorRule, ...]:
    return (
        *_context_rules(schema, "input"),
        *_plan_rules(verify_plan_fields(schema), "plan", "cap", "input", label="plan"),
        *_mapping_rules(schema, "extra_slot_tables", "per_slot_fields", ("slots",), "input"),
    )


def _request_rules(*, extend: bool) -> tuple[TensorRule, ...]:
    """The plan's request arrays, int64 [bs]."""
    return (TensorRule("req_pool_indices", "req_pool_indices", "int64", ("bs",), "input"),
            TensorRule("prefix_lens", "prefix_lens", "int64", ("bs",), "input"),
            *((TensorRule("extend_seq_lens", "extend_seq_lens", "int64", ("bs",), "input"),) if extend else ()))


_REQ_TO_TOKEN = TensorRule("req_to_token", "req_to_token", "int32", ("rows", "cols"), "input")
_SWA_LUT = TensorRule("full_to_swa_index_mapping", "full_to_swa_index_mapping", "int64", (None,), "input",
                      optional=True)
_EXPECTED_POOL = (
    TensorRule("req_to_verify_expected_tokens", "req_to_verify_expected_tokens", "int32", (None, None), "input",
               optional=True),
    TensorRule("req_to_verify_expected_tokens_valid_lens", "req_to_verify_expected_tokens_valid_lens", "int64",
               ("bs",), "input", optional=True),
)


def plan_rules(schema: Schema) -> tuple[TensorRule, ...]:
    return (
        _REQ_TO_TOKEN,
        *_plan_rules(verify_plan_fields(schema), "verify_plan_out", "cap", "output", label="plan"),
        *_plan_rules(WRITE_PLAN_FIELDS, "write_plan_out", "wcap", "output", label="plan"),
        *_request_rules(extend=True),
        _SWA_LUT,
        *_EXPECTED_POOL,
        *_mapping_rules(schema, "extra_request_values", "per_request_fields", ("bs",), "input"),
    )


def plan_offsets_rules(schema: Schema) -> tuple[TensorRule, ...]:
    return (
        _REQ_TO_TOKEN,
        TensorRule("out_write_seed_slot_indices", "out_write_seed_slot_indices", "int64", ("wcap",), "output"),
        TensorRule("out_write_offsets", "out_write_offsets", "int64", ("wcap+1",), "output"),
        TensorRule("out_verify_num_valid", "out_verify_num_valid", "int32", (1,), "output"),
        TensorRule("out_verify_enable", "out_verify_enable", "int32", (1,), "output"),
        TensorRule("out_write_num_valid_reqs", "out_write_num_valid_reqs", "int32", (1,), "output"),
        *_request_rules(extend=True),
        TensorRule("out_verify_offsets_scratch", "out_verify_offsets_scratch", "int64", (None,), "output"),
        _SWA_LUT,
    )


def plan_entries_rules(schema: Schema) -> tuple[TensorRule, ...]:
    return (
        _REQ_TO_TOKEN,
        TensorRule("out_verify_slot_indices", "out_verify_slot_indices", "int64", ("cap",), "output"),
        TensorRule("out_verify_expected_tokens", "out_verify_expected_tokens", "int64", ("cap",), "output"),
        TensorRule("out_verify_expected_positions", "out_verify_expected_positions", "int64", ("cap",), "output"),
        TensorRule("out_verify_prev_slot_indices", "out_verify_prev_slot_indices", "int64", ("cap",), "output"),
        TensorRule("verify_enable", "verify_enable", "int32", (1,), "input"),
        *_request_rules(extend=False),
        TensorRule("verify_offsets_scratch", "verify_offsets_scratch", "int64", (None,), "input"),
        _SWA_LUT,
        *_EXPECTED_POOL,
        *_mapping_rules(schema, "extra_request_values", "per_request_fields", ("bs",), "input"),
        *_mapping_rules(schema, "out_extra_verify_expected", "per_request_fields", ("cap",), "output"),
    )


def scatter_rules(schema: Schema) -> tuple[TensorRule, ...]:
    # pool_out may be a view with padded rows (SGLang's scatter steps rows by stride(0) too).
    return (
        TensorRule("pool_out", "pool_out", "int32", (None, None), "output", contiguous=False),
        TensorRule("flat_in", "flat_in", "int64", (None,), "input"),
        TensorRule("req_pool_indices", "req_pool_indices", "int64", ("bs",), "input"),
        TensorRule("offsets", "offsets", "int64", ("bs+1",), "input"),
    )


# -- the table ---------------------------------------------------------------------------------------
_EXTRA_INPUTS = Keyword("extra_inputs", fields="input_fields", what="int64 per-token tensor")
_EXTRA_SLOT_TABLES = Keyword("extra_slot_tables", fields="per_slot_fields", what="int64 [num_slots] tensor")
_EXTRA_REQUEST_VALUES = Keyword("extra_request_values", fields="per_request_fields", what="int64 [bs] tensor")
_OUT_EXTRA = Keyword("out_extra_verify_expected", fields="per_request_fields",
                     what="int64 [verify capacity] output tensor")


def _kw(*names: str) -> tuple[Keyword, ...]:
    return tuple(Keyword(n) for n in names)


OPERATIONS: dict[str, Operation] = {op.name: op for op in (
    Operation(
        "write",
        (*_kw("context", "plan", "input_ids", "positions", "out_cache_loc", "enable_write_input_assert"),
         Keyword("expected_input_tokens", None), Keyword("expected_input_positions", None), _EXTRA_INPUTS),
        "canary_buf", write_rules,
        KernelTemplateSpec(("per_request", "block_per_request"), source_per_shape=True, cpu=True), write_params,
        public=(PublicLaunch("launch_canary_write_kernel",
                             "Write the records of a WritePlan's chains (docs/semantics.md §5.1)."),)),
    Operation(
        "verify",
        (*_kw("context", "plan", "check_verify_expected_token"), _EXTRA_SLOT_TABLES),
        "canary_buf", verify_rules,
        KernelTemplateSpec(("persistent", "fixed_grid"), ("check_verify_expected_token",), cpu=True,
                           entry_order=True), verify_params,
        public=(PublicLaunch("launch_canary_verify_kernel", "Check the entries of a VerifyPlan and append mismatches "
                                                            "to the ring (docs/semantics.md §5.2)."),)),
    # The whole plan: its two stages over a scratch of verify offsets (kv_canary/backends/kernels.py).
    Operation(
        "plan",
        (*_kw("verify_plan_out", "write_plan_out", "req_pool_indices", "prefix_lens", "extend_seq_lens",
              "req_to_token", "swa_window_size", "full_to_swa_index_mapping", "verify_capacity"),
         Keyword("req_to_verify_expected_tokens", None), Keyword("req_to_verify_expected_tokens_valid_lens", None),
         Keyword("kv_token_id_vs_position_offset", 0), _EXTRA_REQUEST_VALUES),
        "req_to_token", plan_rules,
        public=(PublicLaunch("launch_canary_plan_kernels",
                             "Derive the verify and write plans of a batch (docs/semantics.md §5.3)."),)),
    # The plan's two stages take SGLang's keywords of launch_plan_offsets_kernel / launch_plan_entries_kernel.
    Operation(
        "plan_offsets",
        _kw("req_pool_indices", "prefix_lens", "extend_seq_lens", "req_to_token", "full_to_swa_index_mapping",
            "out_verify_offsets_scratch", "out_write_offsets", "out_write_seed_slot_indices", "out_verify_num_valid",
            "out_verify_enable", "out_write_num_valid_reqs", "swa_window_size", "verify_capacity"),
        "req_to_token", plan_offsets_rules, KernelTemplateSpec(("single_block",), cpu=True), plan_offsets_params,
        # The plan's two stages, callable one by one (SGLang's test harnesses do): offsets then entries
        # with one scratch array equals one launch_canary_plan_kernels call, byte for byte.
        public=(PublicLaunch("launch_plan_offsets_kernel", "The plan's first stage: the write plan, the verify entry "
                                                           "offsets (into the scratch) and the overflow decision "
                                                           "(docs/semantics.md §5.3).", reference=False),)),
    Operation(
        "plan_entries",
        (*_kw("req_pool_indices", "prefix_lens", "req_to_token", "full_to_swa_index_mapping", "verify_offsets_scratch",
              "verify_enable", "req_to_verify_expected_tokens", "req_to_verify_expected_tokens_valid_lens",
              "out_verify_slot_indices", "out_verify_expected_tokens", "out_verify_expected_positions",
              "out_verify_prev_slot_indices", "kv_token_id_vs_position_offset", "swa_window_size"),
         _EXTRA_REQUEST_VALUES, _OUT_EXTRA),
        "req_to_token", plan_entries_rules, KernelTemplateSpec(("per_entry", "persistent", "fixed_grid"), cpu=True),
        plan_entries_params,
        public=(PublicLaunch("launch_plan_entries_kernel", "The plan's second stage: the verify entries, from the "
                                                           "offsets the first stage wrote (docs/semantics.md §5.3).",
                             reference=False),)),
    Operation(
        "scatter", _kw("flat_in", "offsets", "req_pool_indices", "pool_out"),
        "pool_out", scatter_rules, KernelTemplateSpec(("per_request",), cpu=True), scatter_params,
        public=(PublicLaunch("scatter_req_token_ids", "Copy each request's token ids into its row of the "
                                                      "expected-token pool (docs/semantics.md §5.4)."),
                # SGLang's launcher name for scatter_req_token_ids (its reference keeps the shorter name).
                PublicLaunch("launch_scatter_req_token_ids_kernel",
                             "scatter_req_token_ids under SGLang's launcher name (docs/semantics.md §5.4).",
                             reference=False))),
)}

# -- the plan's two stages ---------------------------------------------------------------------------
# The whole plan runs plan_offsets, then plan_entries, over a scratch of verify offsets between them
# (kv_canary/launch/operations.py Plan). A stage keyword the plan takes too is passed on as it is, an
# `out_<field>` one is that field of the plan data class the plan fills; these are the others, as
# paths over the plan's arguments ("scratch": the scratch).
PLAN_STAGE_OTHER_VALUES = {
    "out_verify_offsets_scratch": "scratch",
    "verify_offsets_scratch": "scratch",
    "out_verify_enable": "verify_plan_out.enable",
    "verify_enable": "verify_plan_out.enable",
}
PLAN_STAGES = ("plan_offsets", "plan_entries")


def plan_stage_values(schema: Schema) -> dict[str, tuple[tuple[str, object], ...]]:
    """stage -> (keyword, its value), in the stage's keyword order: a path over the plan's keywords and
    `scratch`, or for the per-request expected outputs {field: path} (generated/kernel_abi.py PLAN)."""
    plan = {k.name: k.name for k in OPERATIONS["plan"].keywords}
    fields = {f"out_{f.name}": f"{arg}.{f.name}" for arg, group in (("verify_plan_out", verify_plan_fields(schema)),
                                                                    ("write_plan_out", WRITE_PLAN_FIELDS))
              for f in group}
    expected = {f.name: f"verify_plan_out.verify_expected_{f.name}" for f in schema.canary.per_request_fields}
    values = {**fields, **plan, **PLAN_STAGE_OTHER_VALUES, "out_extra_verify_expected": expected}
    return {stage: tuple((k.name, values[k.name]) for k in OPERATIONS[stage].keywords) for stage in PLAN_STAGES}


# kernels.yaml `template:` -> what it accepts (the keys are the templates codegen knows).
KERNEL_TEMPLATES = {name: op.kernel for name, op in OPERATIONS.items() if op.kernel is not None}

# The input-field keywords: keyword -> (the Record property naming its fields, what it maps them to).
FIELD_KEYWORDS = {k.name: (k.fields, k.what) for op in OPERATIONS.values() for k in op.keywords if k.fields}


def kernel_params(schema: Schema, kernel: Kernel) -> tuple[Param, ...]:
    return OPERATIONS[kernel.operation].params(schema)


def _narrowest(a: str, b: str) -> str:
    (alo, ahi), (blo, bhi) = KIND_RANGES[a], KIND_RANGES[b]
    return a if (alo, ahi) == (max(alo, blo), min(ahi, bhi)) else b


def argument_kinds(schema: Schema) -> dict[str, str]:
    """Python arguments whose value must fit a C integer of the kernels -> that integer's kind.

    Three ways a value reaches one: an integer parameter that is the operation argument itself
    (`swa_window_size`), a real-KV parameter taken from a RealKvSource field (`RealKvSource.page_size`),
    and a capacity whose count a kernel stores through an `int*` (`verify_capacity`). Where several
    parameters take one argument, the narrowest type wins.
    """
    out: dict[str, str] = {}

    def add(argument: str, kind: str) -> None:
        out[argument] = _narrowest(out[argument], kind) if argument in out else kind

    for _, ctype, spec in REAL_KV_SOURCE_PARAMS:
        if isinstance(spec, KvField) and C_TYPES[ctype][0] != "ptr":
            add("RealKvSource." + spec.name, C_TYPES[ctype][0])
    for kernel in schema.kernels:
        op = OPERATIONS.get(kernel.operation)
        if op is None or op.params is None:
            continue
        for p in kernel_params(schema, kernel):
            if isinstance(p.source, Int) and p.source.argument:
                add(p.source.argument, p.kind)
            if p.holds_count_of:
                add(p.holds_count_of, ELEMENT_KINDS[p.dtype])
    return dict(sorted(out.items()))


def checked_by_validation(param: Param, kinds: dict[str, str]) -> bool:
    """An integer parameter whose argument validation range-checks against its C type or a narrower
    one (argument_kinds): the binding passes it as it is; every other integer it range-checks."""
    argument = param.source.argument if isinstance(param.source, Int) else ""
    return argument in kinds and _narrowest(kinds[argument], param.kind) == kinds[argument]
