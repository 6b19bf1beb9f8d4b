"""Run a function on N local processes joined in one gloo process group on 127.0.0.1 (the fleet
demo and the fleet tests use it). The parent holds the rendezvous store for the whole run, starts
the ranks (from a forkserver that imported torch once), and kills whatever still runs after
`timeout_s`: every run ends and leaves no process behind. Each rank's result comes back as a RankOutcome.
"""
from __future__ import annotations

import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Optional

from ..engine.config import check_count

HOST = "127.0.0.1"
# What the ranks import before forking from the forkserver (once per parent process).
PRELOAD = ["torch", "torch.distributed", "kv_canary.engine.manager", "kv_canary.engine.distributed", "kv_canary.demo.sim",
           "kv_canary.demo.faults"]


@dataclass
class RankOutcome:
    rank: int
    status: str                  # "ok" (value is fn's result), "error" (fn raised), "exited" (no result)
    value: object = None
    error_type: str = ""         # the exception's class name
    error: str = ""              # its message
    traceback: str = ""
    exitcode: Optional[int] = None

    def describe(self) -> str:
        if self.status == "ok":
            return f"rank {self.rank}: ok"
        if self.status == "error":
            return f"rank {self.rank}: {self.error_type}: {self.error}"
        return f"rank {self.rank}: exited with code {self.exitcode} without a result"


def loopback_interface() -> Optional[str]:
    """The loopback network interface's name (gloo's GLOO_SOCKET_IFNAME), e.g. 'lo'."""
    try:
        return next((name for _, name in socket.if_nameindex() if name.startswith("lo")), None)
    except OSError:
        return None


def run_local_ranks(fn: Callable, world_size: int, *, args: tuple = (), timeout_s: float = 120.0,
                    group_timeout_s: float = 60.0, env: Optional[dict] = None) -> list[RankOutcome]:
    """Call `fn(rank, world_size, *args)` in `world_size` processes after init_process_group("gloo")
    with `group_timeout_s`; `fn` must be a module-level function (it is pickled by name), `env` is
    set in each rank before `fn` runs. Raises TimeoutError (after killing every rank) when the ranks
    have not all finished within `timeout_s`."""
    import torch.distributed as dist

    check_count("world_size", world_size, 1)
    method = "forkserver" if "forkserver" in multiprocessing.get_all_start_methods() else "spawn"
    ctx = multiprocessing.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(PRELOAD)
    store = dist.TCPStore(HOST, 0, world_size + 1, True, timeout=timedelta(seconds=group_timeout_s),
                          wait_for_workers=False)
    out_dir = Path(tempfile.mkdtemp(prefix="kv_canary_ranks_"))
    procs = [ctx.Process(target=_rank_main, name=f"kv-canary-rank{rank}", daemon=True,
                         args=(fn, rank, world_size, store.port, group_timeout_s, dict(env or {}), str(out_dir), args))
             for rank in range(world_size)]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        stuck = [rank for rank, p in enumerate(procs) if p.is_alive()]
        outcomes = [_outcome(rank, p, out_dir) for rank, p in enumerate(procs)]
        if stuck:
            raise TimeoutError(f"kv-canary: local ranks {stuck} of {world_size} were still running after "
                               f"{timeout_s:g} s and were killed; " + "; ".join(o.describe() for o in outcomes))
        return outcomes
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
        shutil.rmtree(out_dir, ignore_errors=True)
        del store


def _outcome(rank: int, proc, out_dir: Path) -> RankOutcome:
    path = out_dir / f"rank{rank}.pkl"
    if path.is_file():
        try:
            return pickle.loads(path.read_bytes())
        except Exception as exc:  # a half-written result (killed while writing)
            return RankOutcome(rank, "exited", exitcode=proc.exitcode, error=f"unreadable result: {exc}")
    return RankOutcome(rank, "exited", exitcode=proc.exitcode)


def _rank_main(fn, rank: int, world_size: int, port: int, group_timeout_s: float, env: dict, out_dir: str,
               args: tuple) -> None:
    os.environ.update(env)
    lo = loopback_interface()
    if lo and "GLOO_SOCKET_IFNAME" not in os.environ:
        os.environ["GLOO_SOCKET_IFNAME"] = lo   # every rank is on this machine: talk over loopback
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # N ranks share this machine's cores
    try:
        timeout = timedelta(seconds=group_timeout_s)
        store = dist.TCPStore(HOST, port, world_size + 1, False, timeout=timeout)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size, timeout=timeout)
        outcome = RankOutcome(rank, "ok", value=fn(rank, world_size, *args))
    except BaseException as exc:  # reported to the parent, whatever it is
        outcome = RankOutcome(rank, "error", error_type=type(exc).__name__, error=str(exc),
                              traceback=traceback.format_exc())
    path = Path(out_dir) / f"rank{rank}.pkl"
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(pickle.dumps(outcome))
    except Exception as exc:  # an unpicklable value
        tmp.write_bytes(pickle.dumps(RankOutcome(rank, "error", error_type=type(exc).__name__,
                                                 error=f"the result could not be pickled: {exc}")))
    tmp.rename(path)
    # No teardown: the rank's collectives have completed, and a group broken by a dead rank must not
    # keep this process alive in its destructor.
    os._exit(0)
