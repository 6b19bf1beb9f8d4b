"""The demo: a CPU serving simulation (`sim`), named fault scenarios (`faults`) and the report.

`kv-canary demo` (or `make demo`) runs a clean simulated serving run, then every fault scenario,
and writes a report; `kv_canary.demo.cli` holds its command line. `kv-canary demo --world-size N`
runs the fleet demo (`fleet`): the engine on N gloo ranks, a fault on rank 1 only. The example schema one scenario
needs ships with the package (kv_canary/schemas/), so an installed wheel runs the demo too.
"""
from __future__ import annotations


def main(argv=None) -> int:
    """`kv-canary demo [options]`; imported lazily so that `kv_canary.demo.sim` stays light."""
    from .cli import main as cli_main

    return cli_main(argv)
