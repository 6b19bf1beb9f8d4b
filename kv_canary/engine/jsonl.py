"""Violations as JSON lines: one object per drained ring row, for log pipelines (docs/violations-jsonl.md).

`ViolationJsonl(source, path)` listens to a canary (a CanaryManager, attached or not yet, or the
SGLang plugin's totals) and appends one line per violation when it drains: the fields of the
`kv_canary violation:` log line (docs/semantics.md §9) as JSON values, the report's totals, and
constant labels. Every object carries `"format": "kv-canary-violation"` and `"version"`; a change
of shape gets a new version (kv_canary/engine/violation.schema.json).
"""
from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Optional

from .violations import Violation, hex64

JSONL_FORMAT = "kv-canary-violation"
JSONL_VERSION = 1
SCHEMA_PATH = Path(__file__).resolve().parent / "violation.schema.json"


def violation_object(v: Violation, *, total_violations: int, ring_overflow: bool,
                     step_when_pumped: Optional[int], labels: Optional[Mapping[str, str]] = None) -> dict:
    """One violation as the sink writes it (the log line's fields, then the report's totals)."""
    reasons = list(v.sglang_reasons)
    return {
        "format": JSONL_FORMAT, "version": JSONL_VERSION,
        "launch_tag": v.launch_tag, "launch_tag_value": v.launch_tag_value,
        "fail_reason": "+".join(reasons) or "none", "fail_reasons": reasons,
        "slot_idx": v.slot, "position": v.position, "stored_token": v.stored_token,
        "expected_token": v.expected_token, "stored_chain_hash": hex64(v.stored_chain_hash),
        "expected_aux": hex64(v.expected_aux), "extra": dict(v.extra), "kind": v.kind, "step": v.step,
        "total_violations": total_violations, "ring_overflow": ring_overflow, "step_when_pumped": step_when_pumped,
        "labels": dict(labels or {}),
    }


class ViolationJsonl:
    """A listener that writes each drained violation of `source` as one JSON line.

    `target`: a path (opened for appending, created with its parent directories) or a text stream
    (left open). `labels`: constant string labels written into every object (e.g. {"rank": "0"}).
    Lines are flushed after every drain, so a log shipper sees a drain's rows together."""

    def __init__(self, source, target, *, labels: Optional[Mapping[str, str]] = None):
        if isinstance(target, (str, Path)):
            path = Path(target)
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                self.stream, self._owned = path.open("a", encoding="utf-8"), True
            except OSError as e:
                raise ValueError(f"kv-canary: cannot open the violations JSON-lines file {path}: "
                                 f"{e.strerror or e}") from None
        elif isinstance(target, io.TextIOBase) or hasattr(target, "write"):
            self.stream, self._owned = target, False
        else:
            raise ValueError(f"kv-canary: ViolationJsonl target must be a path or a text stream, got "
                             f"{type(target).__name__}")
        if labels is not None and not isinstance(labels, Mapping):
            raise ValueError(f"kv-canary: ViolationJsonl labels must be a mapping of str -> str, got "
                             f"{type(labels).__name__}")
        self.source = source
        self.labels = {str(k): str(v) for k, v in (labels or {}).items()}
        self.written = 0
        source.add_listener(self)

    # -- what the canary calls ------------------------------------------------------------------
    def on_violations(self, violations) -> None:
        st = self.source.stats
        step = getattr(self.source, "last_step", None)
        for v in violations:
            obj = violation_object(v, total_violations=st.total, ring_overflow=st.lost > 0, step_when_pumped=step,
                                   labels=self.labels)
            self.stream.write(json.dumps(obj, separators=(",", ":")) + "\n")
        self.written += len(violations)
        self.stream.flush()

    def on_drain(self) -> None:
        pass

    def after_step(self, step: int) -> None:
        pass

    def flush(self) -> None:
        self.stream.flush()

    def close(self) -> None:
        """Stop listening; a file this sink opened is closed."""
        self.source.remove_listener(self)
        if self._owned:
            self.stream.close()
