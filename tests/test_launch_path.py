"""The path of one free-function launch stays short and followable (docs/architecture.md, "The path
of one launch"): traced with profile hooks, a warm launch of each operation on each host backend
calls into at most MAX_FILES project Python files (kv_canary/ and the generated tree), and no
backend or validator looks an operation up by its name on the way."""
from __future__ import annotations

import random
import shutil
import sys
from pathlib import Path

import pytest
from support import scenarios

import kv_canary

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "kv_canary"
MAX_FILES = 6
_NEEDS_GXX = pytest.mark.skipif(shutil.which("g++") is None, reason="g++ not installed")
BACKENDS = ["torch", pytest.param("cpu", marks=_NEEDS_GXX), pytest.param("emulated", marks=_NEEDS_GXX)]
CASES = {  # public launch -> its scenario case
    "launch_canary_write_kernel": scenarios.make_write_case,
    "launch_canary_verify_kernel": scenarios.make_verify_case,
    "launch_canary_plan_kernels": scenarios.make_plan_case,
    "scatter_req_token_ids": scenarios.make_scatter_case,
}


def _project_file(filename: str) -> str | None:
    """`filename` relative to the checkout when it is a project Python file (hand-written or generated)."""
    try:
        rel = Path(filename).resolve().relative_to(ROOT)
    except ValueError:
        return None
    return str(rel) if rel.suffix == ".py" and rel.parts[0] in ("kv_canary", "generated") else None


def files_crossed(launch) -> list[str]:
    """The project Python files whose functions `launch()` calls, in the order first entered."""
    seen: dict[str, None] = {}

    def hook(frame, event, arg):
        if event == "call":
            rel = _project_file(frame.f_code.co_filename)
            if rel is not None:
                seen.setdefault(rel)
    sys.setprofile(hook)
    try:
        launch()
    finally:
        sys.setprofile(None)
    return list(seen)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("name", CASES)
def test_a_launch_crosses_at_most_six_files(name, backend):
    func = getattr(kv_canary.generated.api, name)
    make = CASES[name]
    params = set(func.__code__.co_varnames[: func.__code__.co_kwonlyargcount])

    def launch(seed: int) -> None:
        case = make(random.Random(seed), kv_canary.generated, n_reqs=3)
        func(**{k: v for k, v in case.items() if k in params}, backend=backend)
    launch(0)  # warm: the backend built, the entry points looked up
    case = make(random.Random(1), kv_canary.generated, n_reqs=3)
    args = {k: v for k, v in case.items() if k in params}
    crossed = files_crossed(lambda: func(**args, backend=backend))
    assert crossed[0] == "generated/api.py" and "kv_canary/launch/operations.py" in crossed, crossed
    assert len(crossed) <= MAX_FILES, f"{name} on {backend} crosses {len(crossed)} files: {crossed}"


def test_no_operation_is_dispatched_by_name():
    """The launch path holds no table from an operation's name to its code (its objects are passed)."""
    for path in ("launch/validation.py", "launch/rules.py", "launch/runtime.py", "backends/torch.py",
                 "backends/kernels.py", "backends/emulated.py", "backends/cpu.py", "backends/cuda.py"):
        text = (PACKAGE / path).read_text(encoding="utf-8")
        for pattern in ("_checks[operation]", "getattr(self.reference, operation)", "self._operations[",
                        'getattr(self, "_check_"', 'getattr(self, "_" + op)', "getattr(host, op)"):
            assert pattern not in text, f"kv_canary/{path} dispatches by name again: {pattern}"
