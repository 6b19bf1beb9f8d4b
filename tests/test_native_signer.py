"""The native launch signer (kv_canary/native/signing.cpp): it reads what torch's accessors read,
tells apart every change the Python signer tells apart, survives the inputs a C walk must not crash
on, and is chosen, refused and replaced as KV_CANARY_NATIVE says. Equality is the whole contract of
a signature: every expectation here compares two signatures of the same signer."""
from __future__ import annotations

import dataclasses
import enum
import logging
import shutil

import pytest
import torch

from kv_canary import native
from kv_canary.signature import Unsignable, python_shape_signature, python_signature

pytestmark = pytest.mark.skipif(shutil.which("g++") is None, reason="the native signer is built with g++")


@pytest.fixture(scope="module")
def sign():
    module, why = native.signer()
    if module is None:
        pytest.fail(f"g++ is installed but the native signer is not in use: {why}")
    return module.sign


def test_it_reads_the_fields_torch_reports(sign):
    module, _ = native.signer()
    base = torch.arange(60, dtype=torch.int16).view(3, 4, 5)
    for t in (base, base[1:, ::2], base.permute(2, 0, 1), base[..., 3], base.view(60)[7:]):
        ptr, _, index, shape, strides = module.tensor_fields(t)
        assert (ptr, index, shape, strides) == (t.data_ptr(), -1, tuple(t.shape), t.stride())
        assert module.impl_address(t) == t._cdata


class Mode(enum.IntEnum):
    A = 1
    B = 2


class Plain:
    """An engine's own context class: attributes in __dict__."""

    def __init__(self, **attrs):
        self.__dict__.update(attrs)


@dataclasses.dataclass(slots=True)
class Slotted:
    tensor: torch.Tensor
    size: int


@pytest.mark.parametrize("signer", ["native", "python"])
def test_both_signers_tell_apart_the_same_values(sign, signer):
    s = sign if signer == "native" else python_signature
    t = torch.zeros((4, 4), dtype=torch.int64)
    pairs_equal = [
        (t, t.view(4, 4)),
        (Mode.A, Mode(1)),
        ([1, "x", None, 2.5], [1, "x", None, 2.5]),
        ({"a": t, 3: None}, {"a": t, 3: None}),
        (Plain(x=t, y=1), Plain(x=t, y=1)),
        (Slotted(t, 3), Slotted(t, 3)),
        (10**30, int("1" + "0" * 30)),
    ]
    for a, b in pairs_equal:
        assert s(a) == s(b) and hash(s(a)) == hash(s(b)), (a, b)
    different = [t, t[1:], t.t(), t.view(torch.float64), t.view(16), torch.zeros((4, 4), dtype=torch.int64),
                 torch.zeros((4, 4), dtype=torch.int64, device="meta"), torch.nn.Parameter(t, requires_grad=False),
                 Mode.A, Mode.B, 1, True, 1.0, "1", None, (1,), [1], {"a": 1}, {"b": 1}, {1: 1},
                 Plain(x=t, y=1), Plain(x=t, y=2), Plain(x=t), Slotted(t, 3), Slotted(t, 4), Slotted(t[1:], 3),
                 10**30, 10**30 + 1, -(1 << 63), 1 << 63]
    sigs = [s(v) for v in different]
    assert len(set(sigs)) == len(sigs)


@pytest.mark.parametrize("signer", ["native", "python"])
def test_shape_signatures_keep_an_address_by_its_class(sign, signer):
    """sign_shape: tensors that differ only in where they live (addresses equal modulo the class)
    share a shape signature; one at another alignment, of another shape, strides or dtype, or next to
    another scalar does not."""
    shape = native.signer()[0].sign_shape if signer == "native" else python_shape_signature
    a, b = torch.zeros((4, 4), dtype=torch.int64), torch.zeros((4, 4), dtype=torch.int64)
    assert a.data_ptr() % 16 == b.data_ptr() % 16 == 0
    assert shape({"x": a, "n": 3}, 16) == shape({"x": b, "n": 3}, 16)
    assert shape({"x": a, "n": 3}, 16) != shape({"x": b, "n": 4}, 16)
    raw = torch.zeros(16 * 8 + 8, dtype=torch.uint8)
    off = raw[8:].view(torch.int64).view(4, 4)  # 8 bytes further on: another class modulo 16, same modulo 8
    assert shape(a, 16) != shape(off, 16) and shape(a, 8) == shape(off, 8)
    assert shape(a, 16) != shape(a.t(), 16) and shape(a, 16) != shape(a.view(torch.float64), 16)
    with pytest.raises(ValueError, match="power of two"):
        shape(a, 24)


def test_an_edited_object_is_a_new_signature(sign):
    t = torch.zeros(8, dtype=torch.int64)
    obj, slotted, sources = Plain(x=t, sources=[]), Slotted(t, 1), []
    before = [sign(obj), sign(slotted), sign(sources)]
    obj.x = t[:4]
    slotted.size = 2
    sources.append(t)
    assert [sign(obj), sign(slotted), sign(sources)] != before
    assert all(a != b for a, b in zip(before, [sign(obj), sign(slotted), sign(sources)]))


def test_in_place_metadata_changes_change_the_signature(sign):
    t = torch.zeros((4, 6), dtype=torch.int64)
    seen = {sign(t)}
    t.resize_(3, 6)
    seen.add(sign(t))
    t.as_strided_((3, 6), (1, 3))
    seen.add(sign(t))
    t.data = t.to(torch.int32)
    seen.add(sign(t))
    assert len(seen) == 4


def test_what_it_cannot_sign_raises_instead_of_crashing(sign):
    with pytest.raises(Unsignable):
        sign(object())
    deep = []
    for _ in range(200):
        deep = [deep]
    with pytest.raises(RecursionError):
        sign(deep)
    cycle = []
    cycle.append(cycle)
    with pytest.raises(RecursionError):
        sign(cycle)

    class Unset:
        __slots__ = ("a", "b")
    with pytest.raises(AttributeError):
        sign(Unset())
    sparse = torch.zeros(2, dtype=torch.int64).to_sparse()  # no storage: the TensorImpl refuses, Python decides
    with pytest.raises(RuntimeError, match="doesn't have storage"):
        python_signature(sparse)
    with pytest.raises(RuntimeError, match="doesn't have storage"):
        sign(sparse)


def test_python_code_run_while_signing_cannot_pull_the_walk_apart(sign):
    """A mapping of the engine's own (signed by the Python fallback) that, while it is signed, empties
    the list and the dict being walked around it, whose tensors nothing else holds: the walk keeps
    its own references, so it reads no freed object."""
    from collections.abc import Mapping

    class Emptying(Mapping):
        def __getitem__(self, key):
            return 1

        def __len__(self):
            return 1

        def __iter__(self):
            items.clear()
            mapping.clear()
            return iter(["k"])

    items = [torch.zeros(3) for _ in range(20)] + [Emptying()] + [torch.zeros(5) for _ in range(20)]
    mapping = {f"k{i}": torch.zeros(i) for i in range(20)}
    mapping["emptying"] = Emptying()
    mapping.update({f"m{i}": torch.zeros(i) for i in range(20)})
    first = sign((items, mapping))
    assert items == [] and mapping == {}
    assert first != sign((items, mapping))


def test_signatures_hold_no_tensor(sign):
    import gc
    import weakref
    t = torch.zeros(16)
    ref, sig = weakref.ref(t), sign({"t": t, "obj": Plain(x=t)})
    del t
    gc.collect()
    assert ref() is None and sig is not None


# -- choosing the signer -----------------------------------------------------------------------------------
def test_kv_canary_native_chooses_and_refuses(monkeypatch):
    """native.signer() as a fresh process would run it (its cache bypassed)."""
    from kv_canary.emulation import build as emulation_build
    choose = native.signer.__wrapped__
    monkeypatch.setenv("KV_CANARY_NATIVE", "0")
    assert choose() == (None, "python (KV_CANARY_NATIVE=0)")
    monkeypatch.setenv("KV_CANARY_NATIVE", "yes")
    with pytest.raises(ValueError, match=r"KV_CANARY_NATIVE='yes' is not a choice; expected auto, 1 or 0"):
        choose()

    def no_compiler():  # what emulation.build.compiler raises where PATH has no g++
        raise emulation_build.EmulationBuildError("kv-canary: the emulated backend needs g++ on PATH, found none")
    monkeypatch.setattr(emulation_build, "compiler", no_compiler)
    monkeypatch.setenv("KV_CANARY_NATIVE", "1")
    with pytest.raises(ImportError, match="KV_CANARY_NATIVE=1 but the native signer is unavailable: .*needs g\\+\\+ on PATH"):
        choose()


def test_auto_falls_back_to_python_with_one_warning(monkeypatch, caplog):
    def broken():
        raise native.NativeBuildError("kv-canary: g++ could not build the native signer: (simulated)")
    monkeypatch.setattr(native, "build", broken)
    monkeypatch.setenv("KV_CANARY_NATIVE", "auto")
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        module, why = native.signer.__wrapped__()
    assert module is None and why == "python (native unavailable: kv-canary: g++ could not build the native " \
                                     "signer: (simulated))"
    assert [r.getMessage() for r in caplog.records if "native launch signer is unavailable" in r.getMessage()]
