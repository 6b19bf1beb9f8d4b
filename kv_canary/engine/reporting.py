"""The violation report, a text that engines and their test harnesses parse (docs/semantics.md §9; the
stats line and the health-check error are kv_canary.engine.monitor's). What a row means comes from the
tree's layout (phase coordinates, FailReason kinds, TOKEN_REASON_BITS), never from names.
"""
from __future__ import annotations

from .violations import Violation, hex64

PER_FORWARD_PREFIX = "per_forward_"


class ViolationReporter:
    """Formats §9 violation messages for the violations of one generated tree."""

    def __init__(self, layout):
        self.phase_of = {int(tag): coordinates[0] for tag, coordinates in layout.LAUNCH_TAG_COORDINATES.items()}
        self.token_bits = int(layout.TOKEN_REASON_BITS)
        self.sweep_phase = layout.STEP_SWEEP

    def canary_kind(self, v: Violation) -> str:
        """The tag's name lower-cased, `per_forward_` first unless it is a sweep tag; unknown(N) as is."""
        phase = self.phase_of.get(v.launch_tag_value)
        if phase is None:
            return v.launch_tag
        name = v.launch_tag.lower()
        return name if phase == self.sweep_phase else PER_FORWARD_PREFIX + name

    def message(self, v: Violation, *, total_violations: int, ring_overflow: bool, step_when_pumped: int) -> str:
        """The lines of one row joined by newlines: key=value line, header, kind, reasons, body, footer."""
        reasons = " ".join(v.sglang_reasons) or "none"
        stored = f"token_id={v.stored_token}   position={v.position} prev_hash={hex64(v.stored_chain_hash)}"
        if v.is_write:
            body = [f"  actual:   {stored}", f"  expected: token_id={v.expected_token}   position={v.expected_aux}"]
        else:
            expected_token = f"token_id={v.expected_token} " if v.reason_bits & self.token_bits else ""
            body = [f"  stored:   {stored}", f"  expected: {expected_token}prev_hash={hex64(v.expected_aux)}"]
        return "\n".join([
            v.log_line(),
            f"KV cache canary violation detected (kernel_kind={v.launch_tag}, slot_idx={v.slot}, "
            f"position={v.position})",
            f"canary_kind:       {self.canary_kind(v)}",
            f"  fail_reasons: {reasons}",
            *body,
            f"  total_violations={total_violations} ring_overflow={ring_overflow} step_when_pumped={step_when_pumped}",
        ])
