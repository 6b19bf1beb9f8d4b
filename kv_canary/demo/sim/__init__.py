"""A tiny CPU serving simulation that drives the canary exactly as an engine would.

Paged KV pool with a page allocator, a req_to_token table, radix-style prefix sharing, chunked
prefill, decode (optionally speculative), an SWA pool with a full->SWA translation table, and a
deterministic stand-in model whose K/V bytes derive from (token, position). Faults hook in
through `Engine.hooks` (see kv_canary.demo.faults).
"""
from .config import SimConfig
from .engine import Engine, ForwardBatch, Request
from .model import kv_bytes

__all__ = ["SimConfig", "Engine", "ForwardBatch", "Request", "kv_bytes"]
