"""The JSON-lines violation sink (kv_canary.engine.jsonl): one object per drained row, the log line's
fields as JSON values, valid against its versioned schema; on a manager before or after it attaches."""
from __future__ import annotations

import io
import json
import logging
import re

import jsonschema
import pytest
import torch

from kv_canary.demo import faults
from kv_canary.demo.sim import Engine
from kv_canary.engine.jsonl import JSONL_VERSION, SCHEMA_PATH, ViolationJsonl
from kv_canary.engine.manager import CanaryManager, CanaryViolationError

torch.set_num_threads(1)
SCENARIOS = {sc.name: sc for sc in faults.scenarios()}
SHAPE = json.loads(SCHEMA_PATH.read_text(encoding="utf-8"))
LOG_FIELD = re.compile(r"(\w+)=(\S+)")


def _run(name: str, sink_target, *, steps: int = 24, **manager):
    sc = SCENARIOS[name]
    m = CanaryManager(mode=manager.pop("mode", "log"), sweep_interval=faults.SWEEP, **manager)
    sink = ViolationJsonl(m, sink_target, labels={"scenario": name})   # before the engine attaches it
    engine = Engine(sc.sim, canary=m, hooks=[sc.make_fault()])
    for _ in range(steps):
        engine.step()
    m.flush()
    return m, sink


def test_one_line_per_violation_with_the_log_lines_fields(tmp_path, caplog):
    target = tmp_path / "logs" / "violations.jsonl"   # its directory is created
    with caplog.at_level(logging.WARNING, logger="kv_canary"):
        m, sink = _run("late_write/bytes", target, ring_capacity=4)   # a small ring: rows are lost
    sink.close()
    lines = target.read_text(encoding="utf-8").splitlines()
    objs = [json.loads(line) for line in lines]
    assert m.stats.lost > 0 and len(objs) == m.stats.total - m.stats.lost == len(m.violations) == sink.written
    jsonschema.Draft202012Validator.check_schema(SHAPE)
    logged = [r.getMessage().splitlines()[0] for r in caplog.records if r.getMessage().startswith("kv_canary violation")]
    assert len(logged) == len(objs)
    for obj, v, line in zip(objs, m.violations, logged):
        jsonschema.Draft202012Validator(SHAPE).validate(obj)
        assert (obj["format"], obj["version"], obj["labels"]) == ("kv-canary-violation", JSONL_VERSION,
                                                                  {"scenario": "late_write/bytes"})
        fields = dict(LOG_FIELD.findall(line))
        assert fields == {k: str(obj[k]) for k in fields}
        assert obj["step"] == v.step and obj["ring_overflow"] is True
    assert objs[-1]["total_violations"] == m.stats.total


def test_mode_raise_writes_the_rows_before_it_raises():
    stream = io.StringIO()
    with pytest.raises(CanaryViolationError):
        _run("out_of_range_slot", stream, mode="raise")
    objs = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert objs and {o["fail_reason"] for o in objs} == {"slot_out_of_range"}


def test_bad_targets_are_named(tmp_path):
    m = CanaryManager()
    with pytest.raises(ValueError, match="ViolationJsonl target must be a path or a text stream, got int"):
        ViolationJsonl(m, 3)
    (tmp_path / "file").write_text("")
    with pytest.raises(ValueError, match="cannot open the violations JSON-lines file"):
        ViolationJsonl(m, tmp_path / "file" / "v.jsonl")
    assert m.listeners == []
