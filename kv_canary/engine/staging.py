"""int64 values between the host and the device without stalling a step, both ways; on CUDA through
pinned memory behind events, on the CPU synchronously.

HostStaging refills fixed device tensors in place from host values (what CUDA-graph replay needs: a
captured graph reads the addresses it saw). The copy reads pinned host memory asynchronously, so a
buffer is reused only once the event recorded after its copies completed: a small ring of them
keeps the host from waiting. On the CPU one buffer does.

CounterSnapshot is one asynchronous host copy of device counters, which the stats line, the health
check, the fleet and the metrics read: `ready()` once the device has run past it.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch

from .config import check_count

DEPTH = 4  # pinned staging buffers in flight on CUDA


class HostStaging:
    """int64 host staging of `capacity` elements per upload, for tensors on `device`."""

    def __init__(self, capacity: int, device: torch.device):
        self.capacity = check_count("HostStaging capacity", capacity, 1)
        self.device = torch.device(device)
        self._async = self.device.type == "cuda"
        n = DEPTH if self._async else 1
        self._bufs = [torch.empty(capacity, dtype=torch.int64, pin_memory=self._async) for _ in range(n)]
        self._events: list = [None] * n
        self._next = 0

    def upload(self, pairs: list) -> None:
        """Copy each (values: ints or a CPU tensor, dst) pair into `dst[:len(values)]`, in order; dst is
        1-D int64 (so an asynchronous copy never converts through a pageable temporary)."""
        total = sum(len(v) for v, _ in pairs)
        if total > self.capacity:
            raise ValueError(f"kv-canary: one upload holds at most {self.capacity} values (the capacity fixed "
                             f"at attach), got {total}")
        for values, dst in pairs:
            if dst.dtype != torch.int64 or dst.dim() != 1:
                raise ValueError(f"kv-canary: a fixed input must be a 1-D int64 tensor, got {dst.dtype} "
                                 f"shape {tuple(dst.shape)}")
            if len(values) > dst.shape[0]:
                raise ValueError(f"kv-canary: {len(values)} values do not fit a fixed input of "
                                 f"{dst.shape[0]} elements")
        i = self._next
        self._next = (i + 1) % len(self._bufs)
        if self._events[i] is not None:
            self._events[i].synchronize()  # an earlier asynchronous copy may still read this buffer
        buf, off = self._bufs[i], 0
        for values, dst in pairs:
            n = len(values)
            if n:
                buf[off:off + n] = torch.as_tensor(values, dtype=torch.int64)
                dst[:n].copy_(buf[off:off + n], non_blocking=self._async)
            off += n
        if self._async:
            event = torch.cuda.Event()
            event.record()
            self._events[i] = event


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
