"""The backend logic shared by `cuda` and `emulated`: SEMANTICS.md's four operations expressed as
launches of the generated kernels. Subclasses say how to launch (CuPy on a GPU, ctypes + fibers
on the host) and how big the grid is; everything else - which kernel, which variant, and every
argument by its generated parameter name - is decided here once.

Inputs arrive validated (kv_canary.runtime); the kernels themselves keep every access in bounds.
Nothing here synchronises with the device: sizes come from tensor shapes, never tensor values.
"""
from __future__ import annotations

import torch

from . import args as kargs
from .sources import kernel_abi


class KernelBackend:
    """write / verify / plan / scatter on the generated kernels of one layer."""

    name = "kernels"

    def __init__(self, layer):
        self.layer = layer
        self.layout = layer.layout
        self.abi = kernel_abi(layer)
        if self.abi.LAYOUT_FINGERPRINT != self.layout.LAYOUT_FINGERPRINT or self.abi.ABI_VERSION != self.layout.ABI_VERSION:
            raise ValueError(f"kv-canary: {layer.__name__}.kernel_abi (fingerprint {self.abi.LAYOUT_FINGERPRINT}) and "
                             f"layout (fingerprint {self.layout.LAYOUT_FINGERPRINT}) come from different schemas; "
                             f"run `make generate`")
        self._input_fields = tuple(self.layout.INPUT_FIELDS)

    # -- hooks ----------------------------------------------------------------------------------
    def check_device(self, device: torch.device) -> None:
        raise NotImplementedError

    def launch(self, kernel, entry_point: str, *, work: int, packed: list, device: torch.device) -> None:
        """Run `entry_point` of `kernel`; `work` = the requests or entries the grid covers (blocks_for)."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------------
    def kernel(self, template: str):
        return self.abi.kernel_for_template(template)

    def _run(self, template: str, values: dict, *, work: int, device: torch.device, **flags) -> None:
        kernel = self.kernel(template)
        declared = {name for _, variant in kernel.variants for name, _ in variant}
        for flag, value in flags.items():
            if flag not in declared and value:
                raise ValueError(f"kv-canary: kernel {kernel.name} is not specialised for {flag}=True; declare "
                                 f"`specializations: {{{flag}: [false, true]}}` for it in kernels.yaml")
        entry = kernel.entry_point(**{k: bool(v) for k, v in flags.items() if k in declared})
        self.launch(kernel, entry, work=work, packed=kargs.pack(kernel, values, device=device), device=device)

    def _context_values(self, context) -> dict:
        buf = context.canary_buf
        if buf.stride(1) != 1 or buf.stride(0) % self.layout.CANARY_WORD_BYTES:
            raise ValueError(f"kv-canary: canary_buf rows must be contiguous and {self.layout.CANARY_WORD_BYTES}-byte "
                             f"aligned, got strides {tuple(buf.stride())}")
        values = {
            "canary_buf": buf,
            "num_slots": int(buf.shape[0]),
            "slot_stride_bytes": int(buf.stride(0)),
            "launch_tag": int(context.kernel_kind),
            "violation_ring": context.violation_ring,
            "violation_ring_capacity": int(context.violation_ring.shape[0]),
            "violation_write_index": context.violation_write_index,
            # [extension] per-reason totals; None (also for a context without the field) = a null pointer.
            "violation_reason_counts": getattr(context, "violation_reason_counts", None),
            "slot_run_counter": context.slot_run_counter,
            "kernel_run_counter": context.kernel_run_counter,
            "real_kv_num_sources": len(context.real_kv_sources),
            "real_kv_hash_mode": int(context.real_kv_hash_mode),
        }
        align = self.layout.REAL_KV_LOAD_ALIGN_BYTES
        for i in range(self.layout.MAX_REAL_KV_SOURCES):
            src = context.real_kv_sources[i] if i < len(context.real_kv_sources) else None
            t = src.tensor if src is not None else None
            if t is not None and t.data_ptr() % align:
                raise ValueError(f"kv-canary: real_kv_sources[{i}].tensor data must be {align}-byte aligned for the "
                                 f"vector loads, got address {t.data_ptr():#x} (storage offset {t.storage_offset()})")
            values.update({
                f"real_kv_ptr_{i}": t.data_ptr() if t is not None else None,
                f"real_kv_row_stride_bytes_{i}": int(t.stride(0)) * t.element_size() if t is not None else 0,
                f"real_kv_num_rows_{i}": int(t.shape[0]) if t is not None else 0,
                f"real_kv_page_size_{i}": int(src.page_size) if src is not None else 0,
                f"real_kv_num_bytes_per_token_{i}": int(src.num_bytes_per_token) if src is not None else 0,
                f"real_kv_read_bytes_{i}": int(src.read_bytes) if src is not None else 0,
            })
        return values

    # -- the four operations (backend contract, kv_canary/backends/__init__.py) ------------------
    def write(self, *, context, plan, input_ids, positions, out_cache_loc, enable_write_input_assert,
              expected_input_tokens, expected_input_positions, extra_inputs) -> None:
        device = context.canary_buf.device
        self.check_device(device)
        capacity = int(plan.write_seed_slot_indices.shape[0])
        values = self._context_values(context)
        values.update({
            "write_offsets": plan.write_offsets,
            "write_seed_slot_indices": plan.write_seed_slot_indices,
            "write_num_valid_reqs": plan.write_num_valid_reqs,
            "write_req_capacity": capacity,
            "input_ids": input_ids,
            "positions": positions,
            "out_cache_loc": out_cache_loc,
            "num_tokens": int(input_ids.shape[0]),
            "enable_write_input_assert": int(bool(enable_write_input_assert)),
            "expected_input_tokens": expected_input_tokens if enable_write_input_assert else None,
            "expected_input_positions": expected_input_positions if enable_write_input_assert else None,
            "enable_chain_position_assert": context.enable_chain_position_assert,
        })
        for f in self._input_fields:
            values[f"extra_input_{f.name}"] = extra_inputs[f.name]
        self._run("write", values, work=capacity, device=device)

    def verify(self, *, context, plan, check_verify_expected_token, extra_slot_tables) -> None:
        device = context.canary_buf.device
        self.check_device(device)
        capacity = int(plan.verify_slot_indices.shape[0])
        values = self._context_values(context)
        values.update({
            "verify_slot_indices": plan.verify_slot_indices,
            "verify_expected_tokens": plan.verify_expected_tokens,
            "verify_expected_positions": plan.verify_expected_positions,
            "verify_prev_slot_indices": plan.verify_prev_slot_indices,
            "verify_num_valid": plan.verify_num_valid,
            "verify_enable": plan.enable,
            "verify_capacity": capacity,
        })
        for f in self._input_fields:
            if f.verify_expected == "per_request":
                values[f"verify_expected_{f.name}"] = getattr(plan, f"verify_expected_{f.name}")
            elif f.verify_expected == "per_slot":
                values[f"slot_table_{f.name}"] = extra_slot_tables[f.name]
        self._run("verify", values, work=capacity, device=device,
                  check_verify_expected_token=check_verify_expected_token)

    def plan(self, *, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
             swa_window_size, full_to_swa_index_mapping, verify_capacity, req_to_verify_expected_tokens,
             req_to_verify_expected_tokens_valid_lens, kv_token_id_vs_position_offset, extra_request_values) -> None:
        device = req_to_token.device
        self.check_device(device)
        bs = int(req_pool_indices.shape[0])
        verify_cap = int(verify_plan_out.verify_slot_indices.shape[0])
        lut = full_to_swa_index_mapping
        # Per-request verify entry offsets, handed from the first kernel to the second. Allocated
        # from torch's caching allocator (stream-ordered, no sync, fine under graph capture).
        verify_offsets = torch.empty(bs + 1, dtype=torch.int64, device=device)
        common = {
            "req_pool_indices": req_pool_indices,
            "prefix_lens": prefix_lens,
            "batch_size": bs,
            "req_to_token": req_to_token,
            "req_to_token_rows": int(req_to_token.shape[0]),
            "req_to_token_cols": int(req_to_token.shape[1]),
            "req_to_token_row_stride": int(req_to_token.stride(0)),
            "swa_window_size": int(swa_window_size),
            "full_to_swa_index_mapping": lut,
            "swa_lut_len": int(lut.shape[0]) if lut is not None else 0,
            "verify_capacity": verify_cap,
            "verify_num_valid": verify_plan_out.verify_num_valid,
            "verify_enable": verify_plan_out.enable,
            "verify_offsets": verify_offsets,
        }
        self._run("plan_offsets", {
            **common,
            "extend_seq_lens": extend_seq_lens,
            "write_offsets": write_plan_out.write_offsets,
            "write_seed_slot_indices": write_plan_out.write_seed_slot_indices,
            "write_num_valid_reqs": write_plan_out.write_num_valid_reqs,
            "write_req_capacity": int(write_plan_out.write_seed_slot_indices.shape[0]),
        }, work=bs, device=device)

        pool = req_to_verify_expected_tokens
        entries = {
            **common,
            "req_to_verify_expected_tokens": pool,
            "expected_tokens_rows": int(pool.shape[0]) if pool is not None else 0,
            "expected_tokens_cols": int(pool.shape[1]) if pool is not None else 0,
            "expected_tokens_row_stride": int(pool.stride(0)) if pool is not None else 0,
            "req_to_verify_expected_tokens_valid_lens": req_to_verify_expected_tokens_valid_lens,
            "kv_token_id_vs_position_offset": int(kv_token_id_vs_position_offset),
            "verify_slot_indices": verify_plan_out.verify_slot_indices,
            "verify_expected_tokens": verify_plan_out.verify_expected_tokens,
            "verify_expected_positions": verify_plan_out.verify_expected_positions,
            "verify_prev_slot_indices": verify_plan_out.verify_prev_slot_indices,
        }
        for f in self._input_fields:
            if f.verify_expected == "per_request":
                entries[f"request_value_{f.name}"] = extra_request_values[f.name]
                entries[f"verify_expected_{f.name}"] = getattr(verify_plan_out, f"verify_expected_{f.name}")
        self._run("plan_entries", entries, work=verify_cap, device=device)

    def scatter(self, *, flat_in, offsets, req_pool_indices, pool_out) -> None:
        device = pool_out.device
        self.check_device(device)
        bs = int(req_pool_indices.shape[0])
        if bs == 0:
            return  # no request, no launch (a zero-sized grid is not a launch)
        self._run("scatter", {
            "flat_in": flat_in,
            "flat_len": int(flat_in.shape[0]),
            "offsets": offsets,
            "req_pool_indices": req_pool_indices,
            "batch_size": bs,
            "pool_out": pool_out,
            "pool_rows": int(pool_out.shape[0]),
            "pool_cols": int(pool_out.shape[1]),
            "pool_row_stride": int(pool_out.stride(0)),
        }, work=bs, device=device)


def blocks_for(kernel, work: int, *, threads: int, persistent_blocks: int) -> int:
    """Grid size of one launch for the kernel's launch shape (kernels.yaml)."""
    if kernel.shape in ("per_request", "per_entry"):
        return max(1, -(-work // threads))
    if kernel.shape == "block_per_request":
        # One block per request of the plan's capacity (the active count lives on the device, so
        # blocks past it exit at once: no host sync, and a captured graph stays valid).
        return max(1, work)
    if kernel.shape == "single_block":
        return 1
    if kernel.shape == "persistent":
        # Never more blocks than the entries can fill (work = the plan's capacity, a host-side
        # upper bound of the active entries): small verifies launch small grids.
        return max(1, min(persistent_blocks, -(-work // threads)))
    if kernel.shape == "fixed_grid":
        return kernel.blocks
    raise ValueError(f"kv-canary: kernel {kernel.name} has unknown launch shape {kernel.shape!r}")
