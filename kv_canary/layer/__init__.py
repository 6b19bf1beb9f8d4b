"""Layer 1: generated trees and what turns them into code that runs.

A *layer* is one generated package (`kv_canary.generated`, or a tree generated from another
schema). This package finds and imports such trees (`loader`), generates and caches trees of other
schemas (`schemas`), reads their sources (`sources`), checks a compiled module's identity against
its layer (`identity`), keeps one object per package (`memo`), and owns the toolchain: the content-keyed compile cache (`cache`), NVRTC
(`nvrtc`) and the g++ build of the host emulation (`emulation_build`). It imports nothing else of
kv_canary (the import contracts in pyproject.toml, `make lint`).
"""
