"""Tier 1: generated trees (a *tree* is one generated package) and the toolchain that runs them.

What each module owns: docs/architecture.md. It imports nothing else of kv_canary (`make lint`).
"""
