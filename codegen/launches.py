"""The launch table: kv-canary's public launch functions, described once.

generated/api.py renders every function, its `*_torch_reference` variant and `__all__` from this
table; kv_canary.launch.runtime dispatches them generically (`validate_<operation>` then the backend's
`<operation>`). Adding a launch is a row here, a validator and a backend operation
(docs/adding-a-kernel.md).

Signatures are SGLang's: keyword-only, in SGLang's order, with its defaults. Keywords for the input
fields a schema declares (SEMANTICS.md §8) appear only when the schema has such fields. The rows
follow sgl-project/sglang python/sglang/kernels/ops/kv_canary (the version whose
launch_canary_plan_kernels takes verify_plan_out, write_plan_out, req_pool_indices, ...; see
docs/sglang-compat.md, "Names").
"""
from __future__ import annotations

from dataclasses import dataclass

from .model import Schema


@dataclass(frozen=True)
class Arg:
    name: str
    default: str | None = None      # Python source of the default; None: a required keyword


@dataclass(frozen=True)
class PublicLaunch:
    name: str                       # the public (SGLang) name
    operation: str                  # backend operation and validator: kv_canary.launch.validation.validate_<operation>
    args: tuple[Arg, ...]           # keyword-only, in order
    device_of: str                  # dotted path of the argument whose device chooses the backend
    doc: str                        # one line
    reference: bool = True          # also generate `<name>_torch_reference` (always the torch reference)


# Schema-dependent keywords: (keyword, which input fields make it appear, what it maps them to).
FIELD_KEYWORDS = {
    "extra_inputs": ("input_fields", "int64 per-token tensor"),
    "extra_slot_tables": ("per_slot_fields", "int64 [num_slots] tensor"),
    "extra_request_values": ("per_request_fields", "int64 [bs] tensor"),
    "out_extra_verify_expected": ("per_request_fields", "int64 [verify capacity] output tensor"),
}

# Public functions of every layer's api that are not launches (rendered by templates/python/api.py.j2).
HELPERS = ("compute_slot_hash", "use_torch_reference")


def _field_arg(schema: Schema, keyword: str) -> tuple[Arg, ...]:
    fields = getattr(schema.canary, FIELD_KEYWORDS[keyword][0])
    return (Arg(keyword),) if fields else ()


_SCATTER_ARGS = (Arg("flat_in"), Arg("offsets"), Arg("req_pool_indices"), Arg("pool_out"))


def launches(schema: Schema) -> tuple[PublicLaunch, ...]:
    """The public launches of this schema, in `__all__` order."""
    return (
        PublicLaunch(
            "launch_canary_write_kernel", "write",
            (Arg("context"), Arg("plan"), Arg("input_ids"), Arg("positions"), Arg("out_cache_loc"),
             Arg("enable_write_input_assert"), Arg("expected_input_tokens", "None"),
             Arg("expected_input_positions", "None"), *_field_arg(schema, "extra_inputs")),
            "context.canary_buf", "Write the records of a WritePlan's chains (SEMANTICS.md §5.1)."),
        PublicLaunch(
            "launch_canary_verify_kernel", "verify",
            (Arg("context"), Arg("plan"), Arg("check_verify_expected_token"),
             *_field_arg(schema, "extra_slot_tables")),
            "context.canary_buf", "Check the entries of a VerifyPlan and append mismatches to the ring (SEMANTICS.md §5.2)."),
        PublicLaunch(
            "launch_canary_plan_kernels", "plan",
            (Arg("verify_plan_out"), Arg("write_plan_out"), Arg("req_pool_indices"), Arg("prefix_lens"),
             Arg("extend_seq_lens"), Arg("req_to_token"), Arg("swa_window_size"), Arg("full_to_swa_index_mapping"),
             Arg("verify_capacity"), Arg("req_to_verify_expected_tokens", "None"),
             Arg("req_to_verify_expected_tokens_valid_lens", "None"), Arg("kv_token_id_vs_position_offset", "0"),
             *_field_arg(schema, "extra_request_values")),
            "req_to_token", "Derive the verify and write plans of a batch (SEMANTICS.md §5.3)."),
        PublicLaunch(
            "scatter_req_token_ids", "scatter", _SCATTER_ARGS,
            "pool_out", "Copy each request's token ids into its row of the expected-token pool (SEMANTICS.md §5.4)."),
        # The plan's two stages, callable one by one (SGLang's test harnesses do): offsets then entries
        # with one scratch array equals one launch_canary_plan_kernels call, byte for byte.
        PublicLaunch(
            "launch_plan_offsets_kernel", "plan_offsets",
            (Arg("req_pool_indices"), Arg("prefix_lens"), Arg("extend_seq_lens"), Arg("req_to_token"),
             Arg("full_to_swa_index_mapping"), Arg("out_verify_offsets_scratch"), Arg("out_write_offsets"),
             Arg("out_write_seed_slot_indices"), Arg("out_verify_num_valid"), Arg("out_verify_enable"),
             Arg("out_write_num_valid_reqs"), Arg("swa_window_size"), Arg("verify_capacity")),
            "req_to_token", "The plan's first stage: the write plan, the verify entry offsets (into the scratch) "
                            "and the overflow decision (SEMANTICS.md §5.3).",
            reference=False),
        PublicLaunch(
            "launch_plan_entries_kernel", "plan_entries",
            (Arg("req_pool_indices"), Arg("prefix_lens"), Arg("req_to_token"), Arg("full_to_swa_index_mapping"),
             Arg("verify_offsets_scratch"), Arg("verify_enable"), Arg("req_to_verify_expected_tokens"),
             Arg("req_to_verify_expected_tokens_valid_lens"), Arg("out_verify_slot_indices"),
             Arg("out_verify_expected_tokens"), Arg("out_verify_expected_positions"),
             Arg("out_verify_prev_slot_indices"), Arg("kv_token_id_vs_position_offset"), Arg("swa_window_size"),
             *_field_arg(schema, "extra_request_values"), *_field_arg(schema, "out_extra_verify_expected")),
            "req_to_token", "The plan's second stage: the verify entries, from the offsets the first stage wrote "
                            "(SEMANTICS.md §5.3).",
            reference=False),
        # SGLang's launcher name for scatter_req_token_ids (its reference keeps the shorter name).
        PublicLaunch(
            "launch_scatter_req_token_ids_kernel", "scatter", _SCATTER_ARGS,
            "pool_out", "scatter_req_token_ids under SGLang's launcher name (SEMANTICS.md §5.4).", reference=False),
    )


def public_names(schema: Schema) -> tuple[str, ...]:
    """`__all__` of generated/api.py: every launch, every `_torch_reference` variant, then the helpers."""
    table = launches(schema)
    return (tuple(x.name for x in table) + tuple(f"{x.name}_torch_reference" for x in table if x.reference)
            + HELPERS)
