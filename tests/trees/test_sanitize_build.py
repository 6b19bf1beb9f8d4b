"""The sanitizer builds of the two host libraries share one helper (kv_canary/trees/sanitize.py); each
library keeps its own error class and names itself in the refusal."""
from __future__ import annotations

import pytest

import kv_canary
from kv_canary.trees import cpu_build, emulation_build, sanitize


@pytest.mark.parametrize("module, error, library", [(cpu_build, cpu_build.CpuBuildError, "cpu"),
                                                    (emulation_build, emulation_build.EmulationBuildError,
                                                     "emulation")])
def test_a_sanitized_build_without_the_asan_runtime_is_refused(monkeypatch, module, error, library):
    monkeypatch.setenv(sanitize.ENV_SANITIZE, "1")
    monkeypatch.setattr(sanitize, "asan_runtime_loaded", lambda: False)
    with pytest.raises(error) as caught:
        module.build_library(kv_canary.generated)
    assert str(caught.value) == (
        f"kv-canary: KV_CANARY_EMULATION_SANITIZE=1 builds the {library} library with AddressSanitizer, which loads "
        f"only into a process started with the ASan runtime first (LD_PRELOAD=$(g++ -print-file-name=libasan.so)); "
        f"run `make sanitize`, or unset KV_CANARY_EMULATION_SANITIZE")


def test_build_flags(monkeypatch):
    base = ("-O3",)
    for off in ("", "0"):
        monkeypatch.setenv(sanitize.ENV_SANITIZE, off)
        assert sanitize.build_flags(base, library="cpu", error=ValueError) == (base, False)
    monkeypatch.setenv(sanitize.ENV_SANITIZE, "1")
    monkeypatch.setattr(sanitize, "asan_runtime_loaded", lambda: True)
    assert sanitize.build_flags(base, library="cpu", error=ValueError) == (base + sanitize.SANITIZE_FLAGS, True)
