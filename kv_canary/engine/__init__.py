"""Tier 4: the canary inside a serving engine: the engine contract, CanaryManager and what attaches
to it (docs/architecture.md). Imports only the tiers below (`launch`, `backends`, `trees`).
"""
