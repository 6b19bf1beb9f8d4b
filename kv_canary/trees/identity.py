"""Load-time ABI identity: a compiled module must carry the tree's abi_version and fingerprint.

Every generated module exports both (see kv_canary_layout.cuh); a stale compiled cache, a library
built from another schema or a hand-built module is refused before any launch.
"""
from __future__ import annotations

from .loader import regenerate_command


class AbiMismatchError(RuntimeError):
    """A compiled kernel module does not match the Python package that wants to run it."""


def check_identity(tree, *, module_abi_version: int, module_fingerprint: int, module_desc: str) -> None:
    layout = tree.layout
    want_version, want_fp = int(layout.ABI_VERSION), int(layout.LAYOUT_FINGERPRINT, 16)
    got_version, got_fp = int(module_abi_version), int(module_fingerprint) & ((1 << 64) - 1)
    if (got_version, got_fp) == (want_version, want_fp):
        return
    differs = []
    if got_version != want_version:
        differs.append(f"abi_version {got_version} (module) != {want_version} (Python package)")
    if got_fp != want_fp:
        differs.append(f"layout fingerprint {got_fp:016x} (module) != {want_fp:016x} (Python package)")
    raise AbiMismatchError(
        f"kv-canary: refusing to run {module_desc}: it was built from a different schema than the "
        f"Python package {tree.__name__}: {'; '.join(differs)}. Regenerate with `{regenerate_command(tree)}` "
        f"so the tree matches its schema, and rebuild the module "
        f"from the regenerated sources (the kv-canary cache rebuilds automatically when sources change).")
