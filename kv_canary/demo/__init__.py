"""The demo (`kv-canary demo`, `make demo`): a CPU serving simulation (`sim`), named fault scenarios
(`faults`), the report, and the fleet demo on local gloo ranks (`fleet`); `cli` is its command line.
"""
from __future__ import annotations


def main(argv=None) -> int:
    """`kv-canary demo [options]`; imported lazily so that `kv_canary.demo.sim` stays light."""
    from .cli import main as cli_main

    return cli_main(argv)
