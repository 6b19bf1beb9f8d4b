"""The launch table: kv-canary's public launch functions, described once.

generated/api.py renders every function, its `*_torch_reference` variant and `__all__` from this
table; kv_canary.launch.runtime dispatches them generically (`Validators.check(operation,
arguments)`, then the backend's `<operation>`). A public launch is a row naming an operation of codegen/operations.py, whose
keywords it takes (docs/adding-a-kernel.md).

Signatures are SGLang's: keyword-only, in SGLang's order, with its defaults. Keywords for the input
fields a schema declares (docs/semantics.md §8) appear only when the schema has such fields; the argument
whose device chooses the backend is the operation's first tensor. The rows
follow sgl-project/sglang python/sglang/kernels/ops/kv_canary (the version whose
launch_canary_plan_kernels takes verify_plan_out, write_plan_out, req_pool_indices, ...; see
docs/sglang-compat.md, "Names").
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import Schema
from .operations import OPERATIONS, Keyword


@dataclass(frozen=True)
class PublicLaunch:
    name: str                       # the public (SGLang) name
    operation: str                  # the operation it runs (codegen/operations.py OPERATIONS)
    args: tuple[Keyword, ...]       # keyword-only, in order: the operation's, as this schema has them
    device_of: str                  # dotted path of the argument whose device chooses the backend
    doc: str                        # one line
    reference: bool = True          # also generate `<name>_torch_reference` (always the torch reference)


# Public functions of every layer's api that are not launches (rendered by templates/python/api.py.j2).
HELPERS = ("compute_slot_hash", "use_torch_reference")

# What a layer's `allocators` module exports (templates/python/allocators.py.j2): the runtime's
# allocators for the layer (kv_canary/launch/allocation.py allocators_for builds the same names).
ALLOCATOR_NAMES = ("RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "allocate_canary_buf",
                   "canary_buf_bytes", "allocate_violation_ring", "violation_ring_bytes", "allocate_reason_counts",
                   "allocate_counter", "allocate_counters", "allocate_chain_position_flag", "allocate_context")

# (public name, operation, doc, with a `_torch_reference` variant), in `__all__` order.
ROWS = (
    ("launch_canary_write_kernel", "write", "Write the records of a WritePlan's chains (docs/semantics.md §5.1).", True),
    ("launch_canary_verify_kernel", "verify",
     "Check the entries of a VerifyPlan and append mismatches to the ring (docs/semantics.md §5.2).", True),
    ("launch_canary_plan_kernels", "plan", "Derive the verify and write plans of a batch (docs/semantics.md §5.3).", True),
    ("scatter_req_token_ids", "scatter",
     "Copy each request's token ids into its row of the expected-token pool (docs/semantics.md §5.4).", True),
    # The plan's two stages, callable one by one (SGLang's test harnesses do): offsets then entries
    # with one scratch array equals one launch_canary_plan_kernels call, byte for byte.
    ("launch_plan_offsets_kernel", "plan_offsets",
     "The plan's first stage: the write plan, the verify entry offsets (into the scratch) and the overflow "
     "decision (docs/semantics.md §5.3).", False),
    ("launch_plan_entries_kernel", "plan_entries",
     "The plan's second stage: the verify entries, from the offsets the first stage wrote (docs/semantics.md §5.3).",
     False),
    # SGLang's launcher name for scatter_req_token_ids (its reference keeps the shorter name).
    ("launch_scatter_req_token_ids_kernel", "scatter",
     "scatter_req_token_ids under SGLang's launcher name (docs/semantics.md §5.4).", False),
)


def public_args(schema: Schema, operation: str) -> tuple[Keyword, ...]:
    """An operation's keywords as its public functions take them: an input-field keyword only when
    the schema has such fields."""
    return tuple(k for k in OPERATIONS[operation].keywords if not k.fields or getattr(schema.canary, k.fields))


def launches(schema: Schema) -> tuple[PublicLaunch, ...]:
    """The public launches of this schema, in `__all__` order."""
    return tuple(PublicLaunch(name, op, public_args(schema, op), OPERATIONS[op].tensors(schema)[0].path, doc,
                              reference) for name, op, doc, reference in ROWS)


def public_names(schema: Schema) -> tuple[str, ...]:
    """`__all__` of generated/api.py: every launch, every `_torch_reference` variant, then the helpers."""
    table = launches(schema)
    return (tuple(x.name for x in table) + tuple(f"{x.name}_torch_reference" for x in table if x.reference)
            + HELPERS)
