"""What follows a canary's steps and drains: listeners (Prometheus metrics, the fleet decision, the
JSON-lines violation sink). A listener has `after_step(step)` and `on_drain()`; optionally
`on_violations(violations)` (the rows a drain decoded, in ring order) and `flush()` (a run ended:
bring everything up to date now). One whose `takes_errors` is true also takes the raises of what it
listens to (`defer(error)`) and runs after the others. A listener may be added before its canary is
attached to an engine: it hears nothing until the engine runs.
"""
from __future__ import annotations


class Listened:
    """The listener list of one canary (`self.listeners`, set by the subclass's __init__)."""

    listeners: list

    def add_listener(self, listener) -> None:
        self.listeners.append(listener)

    def remove_listener(self, listener) -> None:
        self.listeners = [x for x in self.listeners if x is not listener]

    def listener(self, kind: type):
        """The attached listener of class `kind` (None when there is none)."""
        return next((x for x in self.listeners if isinstance(x, kind)), None)

    def notify_step(self, step: int, error: Exception | None = None) -> None:
        """Every listener's after_step, those that take errors last; `error` (a health failure, say)
        is raised before them, or handed to the one that takes errors."""
        for x in self.listeners:
            if not getattr(x, "takes_errors", False):
                x.after_step(step)
        if error is not None:
            self.raise_or_defer(error)
        for x in self.listeners:
            if getattr(x, "takes_errors", False):
                x.after_step(step)

    def notify_drain(self, violations=()) -> None:
        for x in self.listeners:
            if violations and hasattr(x, "on_violations"):
                x.on_violations(violations)
            x.on_drain()

    def notify_flush(self) -> None:
        for x in self.listeners:
            if hasattr(x, "flush"):
                x.flush()

    def raise_or_defer(self, error: Exception) -> None:
        decider = next((x for x in self.listeners if getattr(x, "takes_errors", False)), None)
        if decider is None:
            raise error
        decider.defer(error)  # no rank raises alone: every rank raises at the fleet decision
