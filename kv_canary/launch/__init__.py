"""Layer 3: one launch, from the public call to a backend.

`runtime` (the Runtime of a layer: validate, choose a backend, bind, run; prepared launches),
`validation` (every host-side check, docs/semantics.md §7) and `allocation` (the launch data classes and
allocators, SGLang's names). Imports only `backends` and `layer` (docs/architecture.md).
"""
