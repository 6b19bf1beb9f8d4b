"""Value checks that only host backends (torch, emulated) can make: they read index tensors.

A request row outside req_to_token (or outside the scatter's pool) and an SWA index outside the
LUT are engine bugs that a bug detector must not hide, so host backends raise a ValueError naming
the argument, the index and the bound before anything is written (docs/semantics.md §5.3, §7). The
CUDA kernels cannot raise without synchronising the host: there such a request row is inactive
(plan) or skipped (scatter), and an unreadable SWA index becomes kvc::PLAN_UNREADABLE_INDEX,
which verify and write then report as SLOT_OUT_OF_RANGE (kv_canary/csrc/kvc_plan.cuh).
"""
from __future__ import annotations

import numpy as np
import torch


def _host(t: torch.Tensor) -> np.ndarray:
    """A read-only look at `t`'s values on the host. Through DLPack, not Tensor.numpy(): numpy()
    marks the caller's storage non-resizable for good, a side effect no check may have."""
    return np.from_dlpack(t.detach().to("cpu"))


class HostChecks:
    """The checks of one generated layer (its padding row and its §7 message texts); `swa=False`
    leaves out the SWA indices (the torch reference checks those itself)."""

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

    # -- what each operation checks, before any kernel writes ------------------------------------
    def plan(self, args: dict) -> None:
        self.plan_rows(**args)
        self.swa_indices(**args)  # both stages' indices

    def plan_offsets(self, args: dict) -> None:
        self.plan_rows(**args)
        self.swa_seed_indices(**args)

    def plan_entries(self, args: dict) -> None:
        self.plan_rows(**args)
        self.plan_scratch(**args)
        self.swa_entry_indices(**args)

    def scatter(self, args: dict) -> None:
        self.scatter_rows(**args)

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
