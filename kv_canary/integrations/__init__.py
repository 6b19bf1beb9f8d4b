"""Adapters that attach kv-canary to serving engines (one subpackage per engine)."""
