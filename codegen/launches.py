"""kv-canary's public launch functions, from the operation table (each operation's `public` launches).

generated/api.py renders every function, its `*_torch_reference` variant and `__all__` from them; each
hands its arguments to its operation object (kv_canary/launch/operations.py: `Operation.validate`,
then the backend's launch of that operation). A public launch is declared with its operation in
codegen/operations.py (`Operation.public`) and takes its keywords (docs/adding-a-kernel.md).

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
class LaunchFunction:
    """A public launch function of one schema: its row, with the keywords this schema has."""
    name: str                       # the public (SGLang) name
    operation: str                  # the operation it runs (codegen/operations.py OPERATIONS)
    args: tuple[Keyword, ...]       # keyword-only, in order: the operation's, as this schema has them
    device_of: str                  # dotted path of the argument whose device chooses the backend
    doc: str                        # one line
    reference: bool = True          # also generate `<name>_torch_reference` (always the torch reference)


# Public functions of every tree's api that are not launches (rendered by templates/python/api.py.j2).
HELPERS = ("compute_slot_hash", "use_torch_reference")

# What a tree's `allocators` module exports (templates/python/allocators.py.j2): the runtime's
# allocators for the tree (kv_canary/launch/allocation.py allocators_for builds the same names).
ALLOCATOR_NAMES = ("RealKvSource", "VerifyOrWriteContext", "VerifyPlan", "WritePlan", "allocate_canary_buf",
                   "canary_buf_bytes", "allocate_violation_ring", "violation_ring_bytes", "allocate_reason_counts",
                   "allocate_counter", "allocate_counters", "allocate_chain_position_flag", "allocate_context")

# (public name, operation, doc, with a `_torch_reference` variant), in `__all__` order: each operation's
# public launches (its `public` in codegen/operations.py), in table order, those with a torch-reference
# variant (SGLang's launchers) before the others (the plan's stages, SGLang's alias of scatter).
ROWS = tuple(sorted(((launch.name, op.name, launch.doc, launch.reference)
                     for op in OPERATIONS.values() for launch in op.public), key=lambda row: not row[3]))


def public_args(schema: Schema, operation: str) -> tuple[Keyword, ...]:
    """An operation's keywords as its public functions take them: an input-field keyword only when
    the schema has such fields."""
    return tuple(k for k in OPERATIONS[operation].keywords if not k.fields or getattr(schema.canary, k.fields))


def launches(schema: Schema) -> tuple[LaunchFunction, ...]:
    """The public launches of this schema, in `__all__` order."""
    return tuple(LaunchFunction(name, op, public_args(schema, op), OPERATIONS[op].tensors(schema)[0].path, doc,
                                reference) for name, op, doc, reference in ROWS)


def public_names(schema: Schema) -> tuple[str, ...]:
    """`__all__` of generated/api.py: every launch, every `_torch_reference` variant, then the helpers."""
    table = launches(schema)
    return (tuple(x.name for x in table) + tuple(f"{x.name}_torch_reference" for x in table if x.reference)
            + HELPERS)
