"""One runtime / emulation library per generated package, and a new one for a package imported anew."""
from __future__ import annotations

import types

import kv_canary
from kv_canary.trees.memo import PerTree


def test_one_object_per_package_and_a_new_one_for_a_reimported_package():
    made = []
    memo = PerTree(lambda tree: made.append(tree) or object())
    first, again = types.ModuleType("some.tree"), types.ModuleType("some.tree")
    a = memo.get(first)
    assert memo.get(first) is a and made == [first]
    b = memo.get(again)  # same name, another module object: never the old package's object
    assert b is not a and made == [first, again] and memo.get(again) is b


def test_runtime_for_is_the_same_runtime_for_the_same_package():
    rt = kv_canary.runtime_for(kv_canary.generated)
    assert rt is kv_canary.runtime_for(kv_canary.generated) and rt.tree is kv_canary.generated
