"""The operations of docs/semantics.md §5 as objects: write, verify, plan (and its two stages,
plan_offsets and plan_entries) and scatter.

Each operation holds everything about itself that is not the schema's: its own checks (on top of the
generated tensor rules, kv_canary/launch/validation.py), the tensor whose device picks the backend,
its reference call (kv_canary/backends/reference.py), its kernel launches and their work sizes, and
the index-value checks a host backend makes before any kernel writes (HostChecks, below).
The generated api (generated/api.py) calls `OPERATION.launch(runtime, backend, arguments)`; backends
and validation take the operation object, so a launch can be followed by reading, with no table of
names in between (docs/architecture.md, "The path of one launch").
"""
from __future__ import annotations

import os
from typing import Optional

import numpy as np
import torch

ENV_BACKEND = "KV_CANARY_BACKEND"


def _host(t: torch.Tensor) -> np.ndarray:
    """A read-only look at `t`'s values on the host. Through DLPack, not Tensor.numpy(): numpy()
    marks the caller's storage non-resizable for good, a side effect no check may have."""
    return np.from_dlpack(t.detach().to("cpu"))


class HostChecks:
    """The index-value checks of one generated layer (its padding row and its §7 message texts);
    `swa=False` leaves out the SWA indices (the torch reference checks those itself). Which of them
    an operation makes is the operation's (its `host_checks`).

    Only host backends (torch, cpu, emulated) can make them: they read index tensors. A request row
    outside req_to_token (or outside the scatter's pool) and an SWA index outside the LUT are engine
    bugs that a bug detector must not hide, so there a ValueError names the argument, the index and
    the bound before anything is written (docs/semantics.md §5.3, §7). The CUDA kernels cannot raise
    without synchronising the host: there such a request row is inactive (plan) or skipped
    (scatter), and an unreadable SWA index becomes kvc::PLAN_UNREADABLE_INDEX, which verify and write
    then report as SLOT_OUT_OF_RANGE (kv_canary/csrc/kvc_plan.cuh)."""

    def __init__(self, layer, *, swa: bool = True):
        self.layout = layer.layout
        self.padding = int(layer.layout.REQ_POOL_IDX_PADDING)
        self.swa = swa

    def request_rows(self, req_pool_indices: torch.Tensor, *, rows: int, table: str) -> None:
        """Every entry is the padding row or a row of `table` ([0, rows))."""
        rp = _host(req_pool_indices)
        bad = ((rp < 0) | (rp >= rows)) & (rp != self.padding)
        if bad.any():
            i = int(np.flatnonzero(bad)[0])
            pad_note = "" if 0 <= self.padding < rows else f" and is not the padding row {self.padding}"
            raise ValueError(f"{self.layout.MESSAGE_PREFIX}req_pool_indices[{i}] = {int(rp[i])} is outside {table} rows "
                             f"[0, {rows}){pad_note}")

    def plan_rows(self, *, req_pool_indices, req_to_token, **_) -> None:
        self.request_rows(req_pool_indices, rows=int(req_to_token.shape[0]), table="req_to_token")

    def scatter_rows(self, *, req_pool_indices, pool_out, **_) -> None:
        self.request_rows(req_pool_indices, rows=int(pool_out.shape[0]), table="pool_out")

    def _verify_ranges(self, req_pool_indices, prefix_lens, req_to_token, swa_window_size):
        """(request rows, window start, verify count) per request, as the plan derives them (docs/semantics.md §5.3)."""
        rp, pre = _host(req_pool_indices), _host(prefix_lens)
        window, max_ctx = int(swa_window_size), int(req_to_token.shape[1])
        active = rp != self.padding  # request_rows ran first: every other row is inside the table
        pre_c = np.clip(pre, 0, max_ctx)
        start = np.maximum(pre_c - window, 0) if window > 0 else np.zeros(rp.size, dtype=np.int64)
        return rp, start, np.where(active, pre_c - start, 0)

    def _check_lut(self, values: np.ndarray, lut_len: int) -> None:
        bad = values >= lut_len
        if bad.any():
            raise self.layout.fail("swa_index", s=int(values[bad][0]), n=lut_len)

    def swa_indices(self, *, verify_capacity, **plan) -> None:
        """Every req_to_token value the whole plan translates lies inside the LUT (negatives pass through).

        A given LUT translates with or without a window (docs/semantics.md §5.3). Same values and order
        as the torch reference: the write seeds, then (when the verify plan does not overflow) the
        entries' slots, then their predecessors, so both raise the same text.
        """
        if not self.swa or plan["full_to_swa_index_mapping"] is None:
            return
        self.swa_seed_indices(**plan)
        rp, start, counts = self._verify_ranges(plan["req_pool_indices"], plan["prefix_lens"], plan["req_to_token"],
                                                plan["swa_window_size"])
        total = int(counts.sum())
        if total == 0 or total > int(verify_capacity):
            return  # an overflowing plan leaves its entries untouched: nothing else is read
        self._swa_entries(rp, start, counts, plan["req_to_token"], plan["full_to_swa_index_mapping"])

    def swa_seed_indices(self, *, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, swa_window_size,
                         full_to_swa_index_mapping, **_) -> None:
        """The plan's first stage: every write seed it translates lies inside the LUT."""
        if not self.swa or full_to_swa_index_mapping is None or int(req_to_token.shape[1]) == 0:
            return  # no LUT, or nothing to translate: every prefix clamps to 0
        rp, pre, ext = _host(req_pool_indices), _host(prefix_lens), _host(extend_seq_lens)
        table = _host(req_to_token).astype(np.int64)
        seeded = (rp != self.padding) & (pre > 0) & (ext > 0)
        self._check_lut(table[rp[seeded], np.minimum(pre[seeded] - 1, table.shape[1] - 1)],
                        int(full_to_swa_index_mapping.shape[0]))

    def swa_entry_indices(self, *, req_pool_indices, prefix_lens, req_to_token, swa_window_size,
                          full_to_swa_index_mapping, verify_enable, **_) -> None:
        """The plan's second stage (its scratch checked by plan_scratch): every entry's slot, then every
        predecessor, lies inside the LUT."""
        if not self.swa or full_to_swa_index_mapping is None or int(_host(verify_enable)[0]) == 0:
            return
        rp, start, counts = self._verify_ranges(req_pool_indices, prefix_lens, req_to_token, swa_window_size)
        if counts.sum():
            self._swa_entries(rp, start, counts, req_to_token, full_to_swa_index_mapping)

    def _swa_entries(self, rp, start, counts, req_to_token, lut) -> None:
        table = _host(req_to_token).astype(np.int64)
        total = int(counts.sum())
        req = np.repeat(np.arange(rp.size), counts)
        pos = start[req] + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = rp[req]
        lut_len = int(lut.shape[0])
        self._check_lut(table[rows, pos], lut_len)
        has_prev = pos > 0
        self._check_lut(table[rows[has_prev], pos[has_prev] - 1], lut_len)

    def plan_scratch(self, *, req_pool_indices, prefix_lens, req_to_token, swa_window_size, verify_offsets_scratch,
                     verify_enable, out_verify_slot_indices, **_) -> None:
        """The plan's second stage reads the verify offsets the first stage wrote for the same batch.

        An enabled plan (verify_enable != 0) whose scratch holds other offsets, or more entries than
        the capacity (the first stage disables such a plan), is a caller's bug: host backends raise.
        A disabled plan reads nothing. (A kernel would take the scratch as it is, never leaving a tensor.)
        """
        if int(_host(verify_enable)[0]) == 0:
            return
        _, _, counts = self._verify_ranges(req_pool_indices, prefix_lens, req_to_token, swa_window_size)
        want = np.concatenate(([0], np.cumsum(counts)))
        got = _host(verify_offsets_scratch)[: want.size]
        bad = np.flatnonzero(got != want)
        prefix = self.layout.MESSAGE_PREFIX
        if bad.size:
            i = int(bad[0])
            raise ValueError(f"{prefix}verify_offsets_scratch[{i}] = {int(got[i])}, but this batch's verify offsets "
                             f"give {int(want[i])}: pass the scratch launch_plan_offsets_kernel filled for the same "
                             f"requests")
        cap = int(out_verify_slot_indices.shape[0])
        if int(want[-1]) > cap:
            raise ValueError(f"{prefix}verify_enable is 1 but the batch has {int(want[-1])} verify entries, more than "
                             f"the capacity {cap} (out_verify_slot_indices length); launch_plan_offsets_kernel "
                             f"disables such a plan (verify_enable = 0)")


class Operation:
    """One operation: `name` is its name in the generated tables (kernel_abi.OPERATIONS, LAUNCHES)."""

    name = ""
    reads_real_kv = False  # write, verify: what validation reads of the real-KV sources, binding takes

    # -- what every operation does the same way --------------------------------------------------------
    def launch(self, runtime, backend: Optional[str], arguments: dict) -> None:
        """Validate `arguments`, choose the backend, bind and run (a free-function launch)."""
        self.prepare(runtime, backend, arguments).run()

    def prepare(self, runtime, backend: Optional[str], arguments: dict):
        """Everything before the kernel call: validation, the backend's choice, its binding (a Prepared)."""
        read = [] if self.reads_real_kv else None
        args = runtime.validators.check(self, arguments, read)
        device = self.device(args)
        # The environment is read only when no backend= names one (a read costs about a microsecond).
        key = (backend, device) if backend is not None else (os.environ.get(ENV_BACKEND), device, None)
        chosen = runtime.chosen.get(key)
        if chosen is None:
            chosen = runtime.choose(backend, device, key)
        prepared = chosen.prepare(self, args, read=read)
        if self.has_host_checks and chosen.checks_index_values is not None:  # a host backend: it reads index values
            host, kernels = runtime.host_checks[chosen.checks_index_values], prepared.run

            def run() -> None:
                self.host_checks(host, args)  # before any kernel writes
                kernels()
            prepared.run = run
        return prepared

    # -- what each operation says of itself -----------------------------------------------------------
    def device(self, args: dict):
        """The device of the tensor that picks the backend."""
        raise NotImplementedError

    def check(self, v, a: dict, read: Optional[list]) -> tuple:
        """The operation's own checks over its keywords (a dict, defaults filled in), with `v` the
        layer's Validators; returns (the backend operation's keywords, the spans of its tensors)."""
        raise NotImplementedError

    def reference(self, ref):
        """The torch reference's function for this operation (`ref`: the layer's generated reference)."""
        raise NotImplementedError

    def kernel_launches(self, backend, args: dict, read: Optional[list]) -> tuple:
        """(device, [bound kernel launch, ...]) on a kernel backend (kv_canary/backends/kernels.py)."""
        raise NotImplementedError

    def host_checks(self, host: HostChecks, args: dict) -> None:
        """What a host backend reads of index values before any kernel writes (none by default)."""

    has_host_checks = False

    def __repr__(self) -> str:
        return f"<kv-canary operation {self.name}>"


def _context_checks(v, a: dict, plan_class: str) -> None:
    if type(a["context"]) is not v.frozen_context:  # a frozen one was checked when it was built
        v.check_context_fields(a["context"])
    v.check_plan_class(a["plan"], plan_class)


class Write(Operation):
    """Write the records of a WritePlan's chains (docs/semantics.md §5.1)."""

    name = "write"
    reads_real_kv = True

    def device(self, args):
        return args["context"].canary_buf.device

    def check(self, v, a, read):
        _context_checks(v, a, "WritePlan")
        enabled = v.check_bool("enable_write_input_assert", a["enable_write_input_assert"])
        missing = (a["expected_input_tokens"] is None, a["expected_input_positions"] is None)
        if enabled and any(missing):
            raise v.fail("expected_inputs_required")
        if not enabled and not all(missing):
            raise v.fail("expected_inputs_forbidden")
        a["extra_inputs"] = v.mapping("extra_inputs", a["extra_inputs"], v.input_fields)
        return v.check_context_tensors(self.name, a, read)

    def reference(self, ref):
        return ref.write

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["context"].canary_buf)
        return device, [backend.bound("write", args, read=read, device=device,
                                      work=int(args["plan"].write_seed_slot_indices.shape[0]))]


class Verify(Operation):
    """Check the entries of a VerifyPlan, appending mismatches to the ring (docs/semantics.md §5.2)."""

    name = "verify"
    reads_real_kv = True

    def device(self, args):
        return args["context"].canary_buf.device

    def check(self, v, a, read):
        _context_checks(v, a, "VerifyPlan")
        v.check_bool("check_verify_expected_token", a["check_verify_expected_token"])
        a["extra_slot_tables"] = v.mapping("extra_slot_tables", a["extra_slot_tables"], v.per_slot_fields)
        return v.check_context_tensors(self.name, a, read)

    def reference(self, ref):
        return ref.verify

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["context"].canary_buf)
        return device, [backend.bound("verify", args, read=read, device=device,
                                      work=int(args["plan"].verify_slot_indices.shape[0]),
                                      check_verify_expected_token=args["check_verify_expected_token"])]


class Plan(Operation):
    """Derive the verify and write plans of a batch: its two stages over a scratch (docs/semantics.md §5.3)."""

    name = "plan"
    has_host_checks = True

    def device(self, args):
        return args["req_to_token"].device

    def check(self, v, a, read):
        v.check_plan_class(a["verify_plan_out"], "VerifyPlan")
        v.check_plan_class(a["write_plan_out"], "WritePlan")
        v.check_capacity("verify_capacity", a["verify_capacity"], "verify_capacity")
        v.check_plan_scalars(a)
        sizes, spans = v.check_tensors(self.name, a)
        if a["verify_capacity"] != sizes["cap"]:
            raise ValueError(f"{v.prefix}verify_capacity must equal verify_plan_out capacity {sizes['cap']}, "
                             f"got {a['verify_capacity']}")
        v.check_plan_sizes(a, sizes)
        return a, spans

    def reference(self, ref):
        return ref.plan

    def host_checks(self, host, args):
        host.plan_rows(**args)
        host.swa_indices(**args)  # both stages' indices

    def kernel_launches(self, backend, args, read):
        """The two stages, as SGLang's launch_canary_plan_kernels calls them, bound over a scratch of
        bs + 1 verify offsets that the first writes and the second reads (allocated once per binding:
        a prepared plan launched twice reuses it, stream-ordered, like any other buffer it binds)."""
        device = backend.device_of(args["req_to_token"])
        bs = int(args["req_pool_indices"].shape[0])
        scratch = args["req_pool_indices"].new_empty(bs + 1)  # int64 on its device; new_empty: half torch.empty's cost
        offsets, entries = backend.abi.PLAN.bind(args, scratch)  # the stages' values, as PLAN.args would bind them
        held = (args, scratch)  # what the stages' values point into
        return device, [backend.bound("plan_offsets", held, values=offsets, work=bs, device=device),
                        backend.bound("plan_entries", held, values=entries, device=device,
                                      work=int(args["verify_plan_out"].verify_slot_indices.shape[0]))]


class PlanOffsets(Operation):
    """The plan's first stage: the write plan, the verify entry offsets (into the scratch) and the
    overflow decision; its outputs are the WritePlan's arrays and the VerifyPlan's scalars."""

    name = "plan_offsets"
    has_host_checks = True

    def device(self, args):
        return args["req_to_token"].device

    def check(self, v, a, read):
        v.check_capacity("verify_capacity", a["verify_capacity"], "verify_capacity")
        v.check_plan_scalars(a)
        sizes, spans = v.check_tensors(self.name, a)
        v.check_plan_sizes(a, sizes, "out_verify_offsets_scratch", entries=False)
        return a, spans

    def reference(self, ref):
        return ref.plan_offsets

    def host_checks(self, host, args):
        host.plan_rows(**args)
        host.swa_seed_indices(**args)

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["req_to_token"])
        return device, [backend.bound("plan_offsets", args, work=int(args["req_pool_indices"].shape[0]),
                                      device=device)]


class PlanEntries(Operation):
    """The plan's second stage: the verify entries, from the offsets the first stage wrote (its
    outputs are the VerifyPlan's entry arrays; their capacity is theirs)."""

    name = "plan_entries"
    has_host_checks = True

    def device(self, args):
        return args["req_to_token"].device

    def check(self, v, a, read):
        v.check_plan_scalars(a)
        sizes, spans = v.check_tensors(self.name, a)
        v.check_plan_sizes(a, sizes, "verify_offsets_scratch")
        return a, spans

    def reference(self, ref):
        return ref.plan_entries

    def host_checks(self, host, args):
        host.plan_rows(**args)
        host.plan_scratch(**args)
        host.swa_entry_indices(**args)

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["req_to_token"])
        return device, [backend.bound("plan_entries", args, work=int(args["out_verify_slot_indices"].shape[0]),
                                      device=device)]


class Scatter(Operation):
    """Copy each request's token ids into its row of the expected-token pool (docs/semantics.md §5.4)."""

    name = "scatter"
    has_host_checks = True

    def device(self, args):
        return args["pool_out"].device

    def check(self, v, a, read):
        sizes, spans = v.check_tensors(self.name, a)
        # pool_out's rows must be contiguous and must not overlap, or requests would land in each other's cells.
        pool_out = a["pool_out"]
        rows, cols = pool_out.shape
        if (cols > 1 and pool_out.stride(1) != 1) or (rows > 1 and pool_out.stride(0) < cols):
            raise ValueError(f"{v.prefix}pool_out rows must be contiguous and must not overlap (stride(1) == 1 and "
                             f"stride(0) >= {cols}), got shape {(rows, cols)} and strides {tuple(pool_out.stride())}")
        return a, spans

    def reference(self, ref):
        return ref.scatter

    def host_checks(self, host, args):
        host.scatter_rows(**args)

    def kernel_launches(self, backend, args, read):
        device = backend.device_of(args["pool_out"])
        bs = int(args["req_pool_indices"].shape[0])
        return device, ([backend.bound("scatter", args, work=bs, device=device)] if bs else [])


WRITE, VERIFY, PLAN, PLAN_OFFSETS, PLAN_ENTRIES, SCATTER = (Write(), Verify(), Plan(), PlanOffsets(), PlanEntries(),
                                                            Scatter())
# The generated tables name operations (kernel_abi.OPERATIONS, api.LAUNCHES); this is the one place a
# name becomes an object (Runtime.bind, the generated api's import).
BY_NAME = {op.name: op for op in (WRITE, VERIFY, PLAN, PLAN_OFFSETS, PLAN_ENTRIES, SCATTER)}
