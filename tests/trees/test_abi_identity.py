"""ABI identity at load time: a kernel module built from another schema's tree is
refused by the Python package with an error that says what differs and how to regenerate."""
from __future__ import annotations

import pytest
from support.trees import EXAMPLE_SCHEMAS, generate_tree

from kv_canary.trees.identity import AbiMismatchError, check_identity
from kv_canary.trees.sources import kernel_abi

pytestmark = pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="g++ not installed")


def _owner_epoch():
    return generate_tree(next(p for p in EXAMPLE_SCHEMAS if p.stem == "owner_epoch"))


def test_library_from_another_schema_is_refused(default_tree):
    from kv_canary.backends.emulated import EmulationLibrary
    from kv_canary.trees.emulation_build import build_library
    other = _owner_epoch()
    path = build_library(other)
    EmulationLibrary(other, path)  # its own tree accepts it
    with pytest.raises(AbiMismatchError) as err:
        EmulationLibrary(default_tree, path)
    text = str(err.value)
    ours, theirs = default_tree.layout, other.layout
    # owner_epoch adds fields, so its layout always differs; whether its abi_version does depends on
    # where kernels.yaml's abi_version stands (a bumped default may equal it): derive, never assume.
    assert theirs.LAYOUT_FINGERPRINT != ours.LAYOUT_FINGERPRINT
    assert f"layout fingerprint {theirs.LAYOUT_FINGERPRINT} (module) != {ours.LAYOUT_FINGERPRINT} (Python package)" in text
    if theirs.ABI_VERSION != ours.ABI_VERSION:
        assert f"abi_version {theirs.ABI_VERSION} (module) != {ours.ABI_VERSION} (Python package)" in text
    else:
        assert "abi_version " not in text  # only what differs is named
    assert "make generate" in text and str(path) in text


def test_library_exports_the_trees_identity(any_tree):
    import ctypes

    from kv_canary.trees.emulation_build import build_library
    abi = kernel_abi(any_tree)
    lib = ctypes.CDLL(str(build_library(any_tree)))
    fp = getattr(lib, abi.EMULATION_LAYOUT_FINGERPRINT_FUNCTION)
    fp.restype = ctypes.c_ulonglong
    assert getattr(lib, abi.EMULATION_ABI_VERSION_FUNCTION)() == any_tree.layout.ABI_VERSION
    assert fp() == int(any_tree.layout.LAYOUT_FINGERPRINT, 16)


def test_generated_header_and_python_agree(any_tree):
    from kv_canary.trees.sources import read_source
    header = read_source(any_tree, kernel_abi(any_tree).HEADER)
    assert f"constexpr int ABI_VERSION = {any_tree.layout.ABI_VERSION};" in header
    assert f"LAYOUT_FINGERPRINT = 0x{any_tree.layout.LAYOUT_FINGERPRINT.upper()}ULL;" in header


def test_only_what_differs_is_named(default_tree):
    layout = default_tree.layout
    fp = int(layout.LAYOUT_FINGERPRINT, 16)
    check_identity(default_tree, module_abi_version=layout.ABI_VERSION, module_fingerprint=fp, module_desc="m")
    with pytest.raises(AbiMismatchError) as err:
        check_identity(default_tree, module_abi_version=layout.ABI_VERSION + 1, module_fingerprint=fp,
                       module_desc="a stale module")
    assert f"abi_version {layout.ABI_VERSION + 1} (module) != {layout.ABI_VERSION} (Python package)" in str(err.value)
    assert "layout fingerprint" not in str(err.value)
    assert "a stale module" in str(err.value)
    with pytest.raises(AbiMismatchError, match="layout fingerprint"):
        check_identity(default_tree, module_abi_version=layout.ABI_VERSION, module_fingerprint=fp ^ 1,
                       module_desc="m")
