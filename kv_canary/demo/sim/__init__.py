"""A tiny CPU serving simulation that drives the canary exactly as an engine would (it implements
kv_canary.engine.contract): paged KV pool, req_to_token, radix prefix sharing, chunked prefill,
(speculative) decode, an SWA pool, and a stand-in model whose K/V bytes derive from (token, position).
"""
from .config import SimConfig
from .engine import Engine, ForwardBatch, Request
from .model import kv_bytes

__all__ = ["SimConfig", "Engine", "ForwardBatch", "Request", "kv_bytes"]
