"""One asynchronous host copy of a manager's device counters, which the stats line, the health check,
the fleet and the metrics read without stalling a step: on CUDA into pinned memory behind an event
(`ready()` once the device has run past it); on the CPU at once.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class CounterSnapshot:
    """The int64 values of `tensors` (flattened, concatenated) as the device holds them when the
    snapshot is taken, in stream order after every launch enqueued before it."""

    def __init__(self, tensors: Sequence[torch.Tensor]):
        device = torch.cat([t.reshape(-1).to(torch.int64) for t in tensors])  # a fresh tensor: later launches cannot change it
        if device.is_cuda:
            self.host = torch.empty(device.shape, dtype=torch.int64, pin_memory=True)
            self.host.copy_(device, non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.host, self.event = device, None

    def ready(self) -> bool:
        """Whether the copy has landed (never waits)."""
        return self.event is None or self.event.query()

    def values(self) -> list[int]:
        """The values; waits for the copy if it has not landed yet."""
        if self.event is not None:
            self.event.synchronize()
        return self.host.tolist()
