"""The backend logic shared by `cuda` and `emulated`: SEMANTICS.md's operations (write, verify, plan
and its two stages, scatter) expressed as launches of the generated kernels. Subclasses say how to launch (CuPy on a GPU, ctypes + fibers
on the host) and how big the grid is; everything else - which kernel, which variant - is decided
here once, and every argument comes from the kernel's generated binding (generated/kernel_abi.py,
rendered from the same parameter list as the CUDA signature).

Inputs arrive validated (kv_canary.runtime); the kernels themselves keep every access in bounds.
Nothing here synchronises with the device: sizes come from tensor shapes, never tensor values.
"""
from __future__ import annotations

import torch

from .sources import kernel_abi


class KernelBackend:
    """write / verify / plan (plan_offsets + plan_entries) / scatter on the generated kernels of one layer."""

    name = "kernels"

    def __init__(self, layer):
        self.layer = layer
        self.layout = layer.layout
        self.abi = kernel_abi(layer)
        if self.abi.LAYOUT_FINGERPRINT != self.layout.LAYOUT_FINGERPRINT or self.abi.ABI_VERSION != self.layout.ABI_VERSION:
            raise ValueError(f"kv-canary: {layer.__name__}.kernel_abi (fingerprint {self.abi.LAYOUT_FINGERPRINT}) and "
                             f"layout (fingerprint {self.layout.LAYOUT_FINGERPRINT}) come from different schemas; "
                             f"run `make generate`")
        self._kernels = {template: self.abi.kernel_for_template(template)
                         for template in ("write", "verify", "plan_offsets", "plan_entries", "scatter")}

    # -- hooks ----------------------------------------------------------------------------------
    def check_device(self, device: torch.device) -> None:
        raise NotImplementedError

    def launch(self, kernel, entry_point: str, *, work: int, args: tuple, device: torch.device) -> None:
        """Run `entry_point` of `kernel` with its bound arguments (kernel.kinds says their C kinds);
        `work` = the requests or entries the grid covers (blocks_for)."""
        raise NotImplementedError

    # -- helpers --------------------------------------------------------------------------------
    def kernel(self, template: str):
        return self._kernels[template]

    def _run(self, template: str, operation: dict, *, work: int, device: torch.device, **flags) -> None:
        """Bind the operation's arguments with the kernel's generated binding and launch it."""
        kernel = self._kernels[template]
        declared = {name for _, variant in kernel.variants for name, _ in variant}
        for flag, value in flags.items():
            if flag not in declared and value:
                raise ValueError(f"kv-canary: kernel {kernel.name} is not specialised for {flag}=True; declare "
                                 f"`specializations: {{{flag}: [false, true]}}` for it in kernels.yaml")
        entry = kernel.entry_point(**{k: bool(v) for k, v in flags.items() if k in declared})
        self.launch(kernel, entry, work=work, args=kernel.bind(**operation), device=device)

    # -- the operations (backend contract, kv_canary/backends/__init__.py) -----------------------
    def write(self, *, context, plan, **rest) -> None:
        device = context.canary_buf.device
        self.check_device(device)
        self._run("write", dict(context=context, plan=plan, kv=self.abi.real_kv_args(context), **rest),
                  work=int(plan.write_seed_slot_indices.shape[0]), device=device)

    def verify(self, *, context, plan, check_verify_expected_token, extra_slot_tables) -> None:
        device = context.canary_buf.device
        self.check_device(device)
        self._run("verify", dict(context=context, plan=plan, check_verify_expected_token=check_verify_expected_token,
                                 extra_slot_tables=extra_slot_tables, kv=self.abi.real_kv_args(context)),
                  work=int(plan.verify_slot_indices.shape[0]), device=device,
                  check_verify_expected_token=check_verify_expected_token)

    def plan(self, *, verify_plan_out, write_plan_out, req_pool_indices, prefix_lens, extend_seq_lens, req_to_token,
             swa_window_size, full_to_swa_index_mapping, verify_capacity, req_to_verify_expected_tokens,
             req_to_verify_expected_tokens_valid_lens, kv_token_id_vs_position_offset, extra_request_values) -> None:
        """The two stages on the plans' arrays, as SGLang's launch_canary_plan_kernels calls them."""
        device = req_to_token.device
        self.check_device(device)
        bs = int(req_pool_indices.shape[0])
        # Per-request verify entry offsets, handed from the first kernel to the second. Allocated
        # from torch's caching allocator (stream-ordered, no sync, fine under graph capture).
        scratch = torch.empty(bs + 1, dtype=torch.int64, device=device)
        common = dict(req_pool_indices=req_pool_indices, prefix_lens=prefix_lens, req_to_token=req_to_token,
                      full_to_swa_index_mapping=full_to_swa_index_mapping, swa_window_size=swa_window_size)
        self._plan_offsets(
            **common, extend_seq_lens=extend_seq_lens, out_verify_offsets_scratch=scratch,
            out_write_offsets=write_plan_out.write_offsets,
            out_write_seed_slot_indices=write_plan_out.write_seed_slot_indices,
            out_verify_num_valid=verify_plan_out.verify_num_valid, out_verify_enable=verify_plan_out.enable,
            out_write_num_valid_reqs=write_plan_out.write_num_valid_reqs, verify_capacity=verify_capacity)
        self._plan_entries(
            **common, verify_offsets_scratch=scratch, verify_enable=verify_plan_out.enable,
            req_to_verify_expected_tokens=req_to_verify_expected_tokens,
            req_to_verify_expected_tokens_valid_lens=req_to_verify_expected_tokens_valid_lens,
            out_verify_slot_indices=verify_plan_out.verify_slot_indices,
            out_verify_expected_tokens=verify_plan_out.verify_expected_tokens,
            out_verify_expected_positions=verify_plan_out.verify_expected_positions,
            out_verify_prev_slot_indices=verify_plan_out.verify_prev_slot_indices,
            kv_token_id_vs_position_offset=kv_token_id_vs_position_offset, extra_request_values=extra_request_values,
            out_extra_verify_expected={name: getattr(verify_plan_out, "verify_expected_" + name)
                                       for name in extra_request_values})

    def plan_offsets(self, **arguments) -> None:
        self.check_device(arguments["req_to_token"].device)
        self._plan_offsets(**arguments)

    def plan_entries(self, **arguments) -> None:
        self.check_device(arguments["req_to_token"].device)
        self._plan_entries(**arguments)

    def _plan_offsets(self, **arguments) -> None:
        self._run("plan_offsets", arguments, work=int(arguments["req_pool_indices"].shape[0]),
                  device=arguments["req_to_token"].device)

    def _plan_entries(self, **arguments) -> None:
        self._run("plan_entries", arguments, work=int(arguments["out_verify_slot_indices"].shape[0]),
                  device=arguments["req_to_token"].device)

    def scatter(self, *, flat_in, offsets, req_pool_indices, pool_out) -> None:
        device = pool_out.device
        self.check_device(device)
        bs = int(req_pool_indices.shape[0])
        if bs == 0:
            return  # no request, no launch (a zero-sized grid is not a launch)
        self._run("scatter", dict(flat_in=flat_in, offsets=offsets, req_pool_indices=req_pool_indices,
                                  pool_out=pool_out), work=bs, device=device)


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
