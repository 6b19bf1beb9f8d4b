"""Process-group plumbing of the fleet: the device its tensors live on, the group's timeout, and one
MAX all-reduce of a [world_size, width] int64 matrix in which each rank fills only its own row
(values >= 0: the result is every rank's row, so a message can name the ranks). It is started
asynchronously and read later, never waiting past the group's timeout; an NCCL-only group reduces
on the manager's CUDA device through pinned memory (kv_canary.engine.staging), so starting an exchange
never blocks the host.
"""
from __future__ import annotations

import time
from datetime import timedelta
from typing import Optional

import torch
import torch.distributed as dist

from ..staging import CounterSnapshot, HostStaging


class FleetCollectiveError(RuntimeError):
    """A fleet collective failed or did not complete within the group's timeout: a rank died,
    stalled or left the fleet early. The process group is unusable afterwards."""


def group_supports(group, device_type: str) -> bool:
    """Whether `group` reduces tensors of `device_type` ("cpu" or "cuda")."""
    types = getattr(group, "_device_types", None)  # the backends' device types (torch >= 2.3)
    if types:
        return any(torch.device(d).type == device_type for d in types)
    backend = str(dist.get_backend(group)).lower()
    return "gloo" in backend or (device_type == "cuda" and "nccl" in backend)


def collective_device(group, manager_device: Optional[torch.device]) -> torch.device:
    """CPU when the group reduces CPU tensors (the fleet's data starts on the host), else the
    manager's CUDA device."""
    if group_supports(group, "cpu"):
        return torch.device("cpu")
    if manager_device is not None and manager_device.type == "cuda" and group_supports(group, "cuda"):
        return manager_device
    raise ValueError(f"kv-canary: FleetMonitor needs a process group that reduces CPU tensors (gloo) or, for a "
                     f"manager on a CUDA device, CUDA tensors (nccl); got backend {dist.get_backend(group)!r} and a "
                     f"manager on {manager_device}")


def group_timeout(group, device: torch.device) -> timedelta:
    """The timeout the group was created with (init_process_group / new_group `timeout=`)."""
    try:
        timeout = group._get_backend(device).options._timeout  # not public API: fall back below
        if isinstance(timeout, timedelta) and timeout > timedelta(0):
            return timeout
    except Exception:
        pass
    return dist.default_pg_timeout


class RowReducer:
    """`start(row)` begins one exchange, `result()` returns every rank's row (waiting at most the
    group's `timeout` after the start). One is in flight at a time: the buffers are reused."""

    def __init__(self, *, group, device: torch.device, timeout: timedelta, rank: int, world_size: int, width: int):
        self.group, self.device, self.timeout, self.rank, self.width = group, device, timeout, rank, width
        # Flat: the MAX all-reduce is element-wise; rank r's row is elements [r * width, (r + 1) * width).
        self.tensor = torch.zeros(world_size * width, dtype=torch.int64, device=device)
        self.stage = HostStaging(world_size * width, device)
        self.work = self.copy = None   # copy: on CUDA, the result's CounterSnapshot on its way to the host
        self.what, self.step, self.started = "", None, 0.0

    @property
    def in_flight(self) -> bool:
        return self.work is not None

    def start(self, row: list[int], *, what: str, step) -> None:
        if self.in_flight:
            raise RuntimeError("kv-canary: RowReducer.start while an exchange is in flight (read its result first)")
        self.what, self.step, self.started = what, step, time.monotonic()
        values = [0] * self.tensor.numel()
        values[self.rank * self.width:(self.rank + 1) * self.width] = row
        try:
            self.stage.upload([(values, self.tensor)])
            self.work = dist.all_reduce(self.tensor, op=dist.ReduceOp.MAX, group=self.group, async_op=True)
            if self.device.type != "cpu":
                self.work.wait()  # NCCL: the current stream waits for the reduce; the host does not
                self.copy = CounterSnapshot([self.tensor])
        except RuntimeError as e:
            self.work = None
            raise self._error(f"failed to start: {_first_line(e)}") from e

    def result(self) -> list[list[int]]:
        """Every rank's row. Raises FleetCollectiveError when the reduce fails or does not complete
        within the group's timeout."""
        try:
            if self.copy is None:
                if self.work.is_completed():
                    self.work.wait()  # returns at once, or raises the reduce's error
                else:
                    left = self.timeout.total_seconds() - (time.monotonic() - self.started)
                    # Work.wait(timeout) blocks until done or raises; 0 would mean "no timeout".
                    self.work.wait(timedelta(seconds=max(left, 1e-3)))
                values = self.tensor.tolist()
            else:
                pause = 1e-5
                while not self.copy.ready():
                    if time.monotonic() - self.started > self.timeout.total_seconds():
                        raise self._error("did not complete")
                    time.sleep(pause)
                    pause = min(2 * pause, 1e-3)
                values = self.copy.values()
        except FleetCollectiveError:
            raise
        except RuntimeError as e:
            raise self._error(f"failed: {_first_line(e)}") from e
        finally:
            self.work = self.copy = None
        return [values[i:i + self.width] for i in range(0, len(values), self.width)]

    def _error(self, what_happened: str) -> FleetCollectiveError:
        elapsed = time.monotonic() - self.started
        return FleetCollectiveError(
            f"kv-canary: the fleet's {self.what} all_reduce started at step={self.step} {what_happened} after "
            f"{elapsed:.1f} s on rank {self.rank} (the group's timeout is {self.timeout.total_seconds():g} s): "
            f"a rank of the fleet died, stalled or stopped calling after_step")


def _first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__
