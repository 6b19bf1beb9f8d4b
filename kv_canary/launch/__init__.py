"""Tier 3: one launch, from the public call to a backend.

`operations` (write, verify, plan and its stages, scatter as objects: each one's checks, reference call,
kernel launches and host index-value checks; `Operation.launch` validates, chooses the backend, binds
and runs), `runtime` (the Runtime of a tree: its validators, allocators and backends; prepared launches),
`rules` (the generic checks of docs/semantics.md §7: tensors against their rules, scalars),
`validation` (the checks of the launch data classes) and `allocation` (the launch data classes and
allocators, SGLang's names). Imports only `backends` and `trees` (docs/architecture.md).
"""
