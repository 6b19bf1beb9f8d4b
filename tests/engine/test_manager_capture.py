"""CanaryManager steps are CUDA-graph capturable: fixed input addresses, and a captured step
replays like an eager one after its inputs are refilled in place."""
from __future__ import annotations

import collections
import dataclasses
import os
import types

import pytest
import torch

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine.manager import CanaryManager

torch.set_num_threads(1)
STEPS = int(os.environ.get("KV_CANARY_SIM_STEPS", "60")) // 2


def _gpu_available() -> bool:
    try:
        import cupy
        return bool(cupy.is_available()) and torch.cuda.is_available()
    except Exception:  # no CuPy, or CuPy without a driver
        return False


def _tensors(value, path: str):
    """(path, tensor) for every tensor inside a launch argument (dicts, tuples, dataclasses)."""
    if isinstance(value, torch.Tensor):
        yield path, value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield from _tensors(v, f"{path}.{k}")
    elif isinstance(value, (tuple, list)):
        for i, v in enumerate(value):
            yield from _tensors(v, f"{path}[{i}]")
    elif dataclasses.is_dataclass(value):
        for f in dataclasses.fields(value):
            yield from _tensors(getattr(value, f.name), f"{path}.{f.name}")


class BindRecorder:
    """Stands in for the manager's Runtime: records every launch it binds (and the tensors bound,
    kept alive so that no later allocation can reuse an address), and counts the runs."""

    def __init__(self, rt):
        self.rt = rt
        self.bound = []            # (launch name, {path: data_ptr}) in binding order
        self.runs = collections.Counter()
        self._alive = []

    def bind(self, name, **arguments):
        prepared = self.rt.bind(name, **arguments)
        tensors = [(path, t) for arg, value in arguments.items() for path, t in _tensors(value, arg)]
        self._alive += [t for _, t in tensors]
        self.bound.append((name, {path: t.data_ptr() for path, t in tensors}))

        def run() -> None:
            self.runs[name] += 1
            prepared.run()
        return types.SimpleNamespace(run=run)

    def __getattr__(self, name):
        return getattr(self.rt, name)


@pytest.mark.parametrize("tree_name", ["default", "owner_epoch", "isolation"])
def test_every_launch_is_bound_once_at_attach_over_manager_buffers(tree_name):
    """The manager binds its launches when it attaches and only runs them while serving: every
    tensor a launch reads keeps its address (what CUDA-graph replay needs), the engine's batch
    tensors among them never (they are staged into the manager's own buffers)."""
    tree = faults.example_tree(tree_name)
    # The default tree runs with the write input assert on: its expected inputs are fixed too.
    m = CanaryManager(tree=tree, mode="raise", sweep_interval=3, enable_write_input_assert=tree is None,
                      request_inputs=faults.SIM_REQUEST_INPUTS)
    rec = m.rt = BindRecorder(m.rt)
    cfg = SimConfig(seed=5, num_pages=40, chunk_size=6, spec_draft_tokens=1, tenants=2 * (tree_name == "isolation"))
    engine = Engine(cfg, canary=m)
    bound_at_attach = len(rec.bound)
    engine.run(STEPS)
    m.drain()
    assert any(r.matched for r in engine.finished + engine.running)  # prefix sharing (sweeps have entries)
    assert len(rec.bound) == bound_at_attach                             # nothing bound while serving
    assert rec.runs["launch_canary_plan_kernels"] == 2 * STEPS             # FULL and SWA, every step
    assert rec.runs["scatter_req_token_ids"] > 3 and rec.runs["launch_canary_verify_kernel"] > 8 * STEPS
    paths = {path for _, bound in rec.bound for path in bound}
    assert {"req_to_verify_expected_tokens_valid_lens", "flat_in", "offsets", "req_pool_indices",
            "plan.verify_slot_indices", "input_ids", "positions", "out_cache_loc"} <= paths
    if tree_name == "owner_epoch":
        assert {"extra_request_values.request_id", "extra_inputs.request_id", "extra_inputs.epoch"} <= paths
    elif tree_name == "isolation":
        assert {"extra_request_values.cache_namespace", "extra_inputs.cache_namespace"} <= paths
    else:
        assert {"expected_input_tokens", "expected_input_positions"} <= paths
    staged = {name: {bound[path] for n, bound in rec.bound if path in bound and n == launch}
              for name, launch, path in (("input_ids", "launch_canary_write_kernel", "input_ids"),
                                         ("req_pool_indices", "launch_canary_plan_kernels", "req_pool_indices"))}
    assert staged == {"input_ids": {m._input_ids.data_ptr()}, "req_pool_indices": {m._req_pool_indices.data_ptr()}}


class _Replay:
    """A stand-in for torch.cuda.CUDAGraph on the CPU: 'capture' records the callable, replay runs it."""

    def __init__(self, fn):
        self.fn = fn

    def replay(self) -> None:
        self.fn()


def _cuda_capture(fn):
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


class GraphedCanary:
    """Drives a manager as CUDA-graph replay does: at the first decode-only step from `capture_at`
    the HEAD and TAIL launches are captured on that step's batch, which becomes static; later
    steps of the same shape copy their batch into it, `prepare` it, and replay."""

    BATCH_TENSORS = ("req_pool_indices", "prefix_lens", "extend_seq_lens", "input_ids", "positions",
                     "out_cache_loc", "swa_out_cache_loc", "token_rids")

    def __init__(self, manager, capture, capture_at: int):
        self.m = manager
        self.capture = capture
        self.capture_at = capture_at
        self.static = None
        self.graphs = None
        self.replays = 0
        self._replaying = False

    def __getattr__(self, name):  # attach, on_tokens, after_step, ...: the manager's own
        return getattr(self.m, name)

    def _same_shape(self, batch) -> bool:
        return all(getattr(batch, n).shape == getattr(self.static, n).shape for n in self.BATCH_TENSORS)

    def head(self, batch) -> None:
        self._replaying = False
        if self.static is None and batch.step >= self.capture_at and len(batch.drafts) == batch.bs - batch.num_padding:
            self.static = batch
            self.m.stage(batch)
            self.graphs = (self.capture(lambda: self.m.launch_head(self.static)),
                           self.capture(lambda: self.m.tail(self.static)))
        elif self.static is not None and self._same_shape(batch):
            for n in self.BATCH_TENSORS:
                getattr(self.static, n).copy_(getattr(batch, n))
            self.m.stage(batch)
        else:
            return self.m.head(batch)
        self._replaying = True
        self.graphs[0].replay()

    def tail(self, batch) -> None:
        if not self._replaying:
            return self.m.tail(batch)
        self.graphs[1].replay()
        self.replays += 1


def _state(m) -> dict:
    out = {f"{g.name}/{h}": b for g in m.groups for h, b in g.bufs.items()}
    out.update(write_index=m.write_index, kernel_runs=m.kernel_run_counters, slot_runs=m.slot_run_counter)
    return {k: v.cpu().clone() for k, v in out.items()}


DEVICES = [pytest.param("cpu", id="cpu-stand-in"),
           pytest.param("cuda", id="cuda-graph",
                        marks=pytest.mark.skipif(not _gpu_available(), reason="no CUDA device visible to CuPy and torch"))]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("tree_name", ["default", "owner_epoch", "isolation"])
def test_a_captured_step_replays_like_an_eager_one(device, tree_name):
    tree = faults.example_tree(tree_name)
    backend = "cuda" if device == "cuda" else None
    # Four long requests admitted together: after one prefill step every batch has the same shape
    # (padding rows keep it when requests finish), so one capture serves many replays.
    cfg = SimConfig(seed=3, num_pages=64, max_running=4, chunk_size=32, prompt_len=(6, 12), output_len=(24, 32),
                    spec_draft_tokens=1, num_requests=4, tenants=2 * (tree_name == "isolation"))

    def manager():
        return CanaryManager(tree=tree, mode="raise", sweep_interval=5, backend=backend,
                             enable_write_input_assert=tree is None, request_inputs=faults.SIM_REQUEST_INPUTS)
    eager = Engine(cfg, canary=manager(), device=device)
    graphed_canary = GraphedCanary(manager(), _cuda_capture if device == "cuda" else _Replay, capture_at=2)
    graphed = Engine(cfg, canary=graphed_canary, device=device)
    for _ in range(STEPS):
        eager.step()
        graphed.step()
        want, got = _state(eager.canary), _state(graphed_canary.m)
        for name in want:
            assert torch.equal(want[name], got[name]), f"step {eager.step_no - 1}: {name} differs"
    assert graphed_canary.replays >= min(10, STEPS - 4)
    assert int(want["kernel_runs"].sum()) > 0 and int(want["write_index"][0]) == 0


def test_host_staging_refills_in_place_and_rejects_what_does_not_fit():
    from kv_canary.engine.staging import HostStaging

    stage = HostStaging(6, torch.device("cpu"))
    a, b = torch.full((4,), 7, dtype=torch.int64), torch.full((3,), 7, dtype=torch.int64)
    ptrs = (a.data_ptr(), b.data_ptr())
    stage.upload([([1, 2], a), (torch.tensor([3, 4, 5]), b)])
    assert a.tolist() == [1, 2, 7, 7] and b.tolist() == [3, 4, 5] and (a.data_ptr(), b.data_ptr()) == ptrs
    with pytest.raises(ValueError, match="at most 6 values .* got 7"):
        stage.upload([([0] * 4, a), ([0] * 3, b)])
    with pytest.raises(ValueError, match="5 values do not fit a fixed input of 4 elements"):
        stage.upload([([0] * 5, a)])
    with pytest.raises(ValueError, match="1-D int64 tensor, got torch.int32"):
        stage.upload([([0], torch.zeros(2, dtype=torch.int32))])
    assert a.tolist() == [1, 2, 7, 7]  # a rejected upload changes nothing
