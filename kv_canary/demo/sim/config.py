"""Configuration of the serving simulation."""
from __future__ import annotations

from dataclasses import dataclass

from ...trees.loader import default_tree

# Real-KV rows are read with aligned vector loads (RealKvSource checks it): bytes per token follow.
_ALIGN = default_tree().layout.REAL_KV_LOAD_ALIGN_BYTES


@dataclass(frozen=True)
class SimConfig:
    seed: int = 0
    num_pages: int = 64            # full-attention pages, page 0 reserved (its slot 0 is the padding slot)
    page_size: int = 4
    bytes_per_token: int = 32      # K (and V) bytes per token per layer; a multiple of _ALIGN
    num_full_layers: int = 2
    num_swa_layers: int = 1        # 0 disables the SWA group
    swa_window: int = 8
    max_running: int = 4           # requests decoded together; req_to_token rows = max_running + 1
    max_ctx: int = 96
    chunk_size: int = 12           # chunked-prefill budget per request and step
    prompt_len: tuple[int, int] = (6, 30)
    output_len: tuple[int, int] = (4, 24)
    vocab: int = 1000
    num_system_prompts: int = 3    # shared prompt prefixes (radix sharing); 0 = none
    system_prompt_len: int = 12
    radix_cache: bool = True
    spec_draft_tokens: int = 0     # >0: decode proposes this many draft tokens per step
    num_requests: int = 10_000     # arrivals stop after this many
    tenants: int = 0               # >0: each request belongs to one of this many tenants (prefix cache keyed on it)
    tenant_kind: str = "cache_salt"  # what tells tenants apart: "cache_salt" or "lora" (an adapter each)

    def __post_init__(self) -> None:
        for name in ("num_pages", "page_size", "num_full_layers", "max_running", "max_ctx", "chunk_size",
                     "vocab"):
            if getattr(self, name) < 1:
                raise ValueError(f"SimConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.bytes_per_token <= 0 or self.bytes_per_token % _ALIGN:
            raise ValueError(f"SimConfig.bytes_per_token must be a positive multiple of {_ALIGN}, "
                             f"got {self.bytes_per_token}")
        if self.num_swa_layers < 0 or (self.num_swa_layers and self.swa_window < 1):
            raise ValueError("SimConfig.swa_window must be >= 1 when num_swa_layers > 0, "
                             f"got num_swa_layers={self.num_swa_layers} swa_window={self.swa_window}")
        lo, hi = self.prompt_len
        if not 2 <= lo <= hi or hi + self.output_len[1] + self.spec_draft_tokens > self.max_ctx:
            raise ValueError(f"SimConfig.prompt_len must satisfy 2 <= lo <= hi and hi + max output + drafts "
                             f"<= max_ctx={self.max_ctx}, got prompt_len={self.prompt_len} "
                             f"output_len={self.output_len}")
        if self.tenants < 0 or self.tenant_kind not in ("cache_salt", "lora"):
            raise ValueError(f"SimConfig.tenants must be >= 0 and tenant_kind 'cache_salt' or 'lora', got "
                             f"tenants={self.tenants} tenant_kind={self.tenant_kind!r}")
        if not 1 <= self.output_len[0] <= self.output_len[1]:
            raise ValueError(f"SimConfig.output_len must satisfy 1 <= lo <= hi, got {self.output_len}")

    @property
    def num_slots(self) -> int:
        return self.num_pages * self.page_size

    @property
    def swa_enabled(self) -> bool:
        return self.num_swa_layers > 0
