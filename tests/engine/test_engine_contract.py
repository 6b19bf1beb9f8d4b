"""The engine contract (kv_canary.engine.contract): the simulation meets it, a broken engine is told
what it misses before anything is allocated."""
from __future__ import annotations

import pytest
import torch

from kv_canary.demo.sim import Engine, SimConfig
from kv_canary.engine import contract
from kv_canary.engine.manager import CanaryManager


def test_the_simulation_is_a_slot_table_engine():
    engine = Engine(SimConfig(num_pages=8, max_ctx=64), canary=None)
    assert isinstance(engine, contract.SlotTableEngine) and contract.slot_table_kind(engine) == "slots"
    contract.check_engine(engine)
    for pool in engine.canary_pools().values():
        assert isinstance(pool.storage, contract.KvStorage)


class _Broken:
    device = torch.device("cpu")
    req_rows = 1

    class cfg:
        max_running = 0
        max_ctx = 16

    def canary_pools(self):
        return {}


@pytest.mark.parametrize("extra, message", [
    ({}, "neither `req_to_token` (slot table) nor `req_to_block` + `block_size` (block table)"),
    ({"req_to_token": torch.zeros((1, 8), dtype=torch.int64)}, "req_to_token must be an int32 [req_rows, columns]"),
    # A block table narrower than max_ctx is allowed (it may grow on demand); a bad block size is not.
    ({"req_to_block": torch.zeros((1, 2), dtype=torch.int32), "block_size": 0}, "block_size must be an int >= 1, got 0"),
])
def test_a_broken_engine_is_told_every_missing_part(extra, message):
    engine = _Broken()
    for k, v in extra.items():
        setattr(engine, k, v)
    with pytest.raises(ValueError) as e:
        CanaryManager().attach(engine)
    text = str(e.value)
    assert "does not meet the engine contract (kv_canary.engine.contract)" in text and message in text
    assert "no `cached_entries`" in text and "cfg.max_running must be an int >= 1, got 0" in text
    assert "req_rows must be an int >= 2" in text


def test_the_manager_imports_nothing_from_the_demo():
    import ast
    import pathlib

    import kv_canary.engine.manager as m
    tree = ast.parse(pathlib.Path(m.__file__).read_text())
    names = [n.module or "" for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)]
    names += [a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names]
    assert names and not [n for n in names if "demo" in n]
