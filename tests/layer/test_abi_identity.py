"""ABI identity at load time: a kernel module built from another schema's tree is
refused by the Python layer with an error that says what differs and how to regenerate."""
from __future__ import annotations

import pytest
from support.layers import EXAMPLE_SCHEMAS, generate_layer

from kv_canary.layer.identity import AbiMismatchError, check_identity
from kv_canary.layer.sources import kernel_abi

pytestmark = pytest.mark.skipif(__import__("shutil").which("g++") is None, reason="g++ not installed")


def _owner_epoch():
    return generate_layer(next(p for p in EXAMPLE_SCHEMAS if p.stem == "owner_epoch"))


def test_library_from_another_schema_is_refused(default_layer):
    from kv_canary.backends.emulated import EmulationLibrary
    from kv_canary.layer.emulation_build import build_library
    other = _owner_epoch()
    path = build_library(other)
    EmulationLibrary(other, path)  # its own layer accepts it
    with pytest.raises(AbiMismatchError) as err:
        EmulationLibrary(default_layer, path)
    text = str(err.value)
    ours, theirs = default_layer.layout, other.layout
    # owner_epoch adds fields, so its layout always differs; whether its abi_version does depends on
    # where kernels.yaml's abi_version stands (a bumped default may equal it): derive, never assume.
    assert theirs.LAYOUT_FINGERPRINT != ours.LAYOUT_FINGERPRINT
    assert f"layout fingerprint {theirs.LAYOUT_FINGERPRINT} (module) != {ours.LAYOUT_FINGERPRINT} (Python layer)" in text
    if theirs.ABI_VERSION != ours.ABI_VERSION:
        assert f"abi_version {theirs.ABI_VERSION} (module) != {ours.ABI_VERSION} (Python layer)" in text
    else:
        assert "abi_version " not in text  # only what differs is named
    assert "make generate" in text and str(path) in text


def test_library_exports_the_layers_identity(any_layer):
    import ctypes

    from kv_canary.layer.emulation_build import build_library
    abi = kernel_abi(any_layer)
    lib = ctypes.CDLL(str(build_library(any_layer)))
    fp = getattr(lib, abi.EMULATION_LAYOUT_FINGERPRINT_FUNCTION)
    fp.restype = ctypes.c_ulonglong
    assert getattr(lib, abi.EMULATION_ABI_VERSION_FUNCTION)() == any_layer.layout.ABI_VERSION
    assert fp() == int(any_layer.layout.LAYOUT_FINGERPRINT, 16)


def test_generated_header_and_python_agree(any_layer):
    from kv_canary.layer.sources import read_source
    header = read_source(any_layer, kernel_abi(any_layer).HEADER)
    assert f"constexpr int ABI_VERSION = {any_layer.layout.ABI_VERSION};" in header
    assert f"LAYOUT_FINGERPRINT = 0x{any_layer.layout.LAYOUT_FINGERPRINT.upper()}ULL;" in header


def test_only_what_differs_is_named(default_layer):
    layout = default_layer.layout
    fp = int(layout.LAYOUT_FINGERPRINT, 16)
    check_identity(default_layer, module_abi_version=layout.ABI_VERSION, module_fingerprint=fp, module_desc="m")
    with pytest.raises(AbiMismatchError) as err:
        check_identity(default_layer, module_abi_version=layout.ABI_VERSION + 1, module_fingerprint=fp,
                       module_desc="a stale module")
    assert f"abi_version {layout.ABI_VERSION + 1} (module) != {layout.ABI_VERSION} (Python layer)" in str(err.value)
    assert "layout fingerprint" not in str(err.value)
    assert "a stale module" in str(err.value)
    with pytest.raises(AbiMismatchError, match="layout fingerprint"):
        check_identity(default_layer, module_abi_version=layout.ABI_VERSION, module_fingerprint=fp ^ 1,
                       module_desc="m")
