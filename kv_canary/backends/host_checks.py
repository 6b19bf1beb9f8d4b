"""Value checks that only host backends (torch, emulated) can make: they read index tensors.

A request row outside req_to_token (or outside the scatter's pool) and an SWA index outside the
LUT are engine bugs that a bug detector must not hide, so host backends raise a ValueError naming
the argument, the index and the bound before anything is written (SEMANTICS.md §5.3, §7). The
CUDA kernels cannot raise without synchronising the host: there such a request row is inactive
(plan) or skipped (scatter), and an unreadable SWA index becomes kvc::PLAN_UNREADABLE_INDEX,
which verify and write then report as SLOT_OUT_OF_RANGE (codegen/templates/cuda/_plan_common.j2).
"""
from __future__ import annotations

import numpy as np
import torch


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().to("cpu").numpy()


class HostChecks:
    """The checks of one generated layer (its padding row and its §7 message texts)."""

    def __init__(self, layer):
        self.layout = layer.layout
        self.padding = int(layer.layout.REQ_POOL_IDX_PADDING)

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

    def swa_indices(self, *, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token, swa_window_size,
                    full_to_swa_index_mapping, verify_capacity, **_) -> None:
        """Every req_to_token value the plan translates lies inside the LUT (negatives pass through).

        A given LUT translates with or without a window (SEMANTICS.md §5.3). Same values and order
        as the torch reference: the write seeds, then (when the verify plan does not overflow) the
        entries' slots, then their predecessors, so both raise the same text.
        """
        if full_to_swa_index_mapping is None:
            return
        window = int(swa_window_size)
        lut_len = int(full_to_swa_index_mapping.shape[0])
        rp, pre, ext = _host(req_pool_indices), _host(prefix_lens), _host(extend_seq_lens)
        table = _host(req_to_token).astype(np.int64)
        max_ctx = table.shape[1]
        active = rp != self.padding  # request_rows ran first: every other row is inside the table

        def check(values: np.ndarray) -> None:
            bad = values >= lut_len
            if bad.any():
                raise self.layout.fail("swa_index", s=int(values[bad][0]), n=lut_len)

        if max_ctx == 0:
            return  # nothing to translate: every prefix clamps to 0
        seeded = active & (pre > 0) & (ext > 0)
        check(table[rp[seeded], np.minimum(pre[seeded] - 1, max_ctx - 1)])
        pre_c = np.clip(pre, 0, max_ctx)
        start = np.maximum(pre_c - window, 0) if window > 0 else np.zeros_like(pre_c)
        counts = np.where(active, pre_c - start, 0)
        total = int(counts.sum())
        if total == 0 or total > int(verify_capacity):
            return  # an overflowing plan leaves its entries untouched: nothing else is read
        req = np.repeat(np.arange(rp.size), counts)
        pos = start[req] + np.arange(total) - np.repeat(np.cumsum(counts) - counts, counts)
        rows = rp[req]
        check(table[rows, pos])
        has_prev = pos > 0
        check(table[rows[has_prev], pos[has_prev] - 1])
