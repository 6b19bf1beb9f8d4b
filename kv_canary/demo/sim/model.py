"""Deterministic stand-in model: K/V bytes are a pure function of (token, position, layer, half), so
any misplaced, stale or damaged byte shows up in the canary's real-KV fingerprint.
"""
from __future__ import annotations

import torch

_M1 = 0x2545F4914F6CDD1D
_M2 = 0x1B873593
_LOW34 = (1 << 34) - 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    # xorshift-multiply rounds on int64 (wrapping); logical shifts emulated by masking.
    for shift, mul in ((29, _M1), (32, _M2)):
        x = x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))
        x = x * mul
    return x ^ ((x >> 30) & _LOW34)


def kv_bytes(tokens: torch.Tensor, positions: torch.Tensor, layer: int, half: int, nbytes: int) -> torch.Tensor:
    """uint8 [n, nbytes] K (half=0) or V (half=1) bytes of `layer` for each (token, position)."""
    words = nbytes // 8
    base = tokens.to(torch.int64) * 1_000_003 + positions.to(torch.int64) * 7919 + (layer * 2 + half) * 104_729
    x = base[:, None] * 31 + torch.arange(words, dtype=torch.int64, device=tokens.device)[None, :]
    return _mix(x).contiguous().view(torch.uint8).reshape(len(tokens), nbytes)


def next_token(rid: int, position: int, vocab: int) -> int:
    """The token the stand-in model samples after `position` of request `rid` (deterministic)."""
    x = _mix(torch.tensor([rid * 65_537 + position], dtype=torch.int64))
    return int(x.item() % vocab)
