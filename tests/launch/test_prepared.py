"""Prepared launches (Runtime.bind): validated and bound once, run many times, rebound by naming
what changed; each ends in the same bytes as the free function on the same arguments."""
from __future__ import annotations

import random

import pytest
from support import scenarios

import kv_canary

HOST_BACKENDS = ["torch", "cpu", "emulated"]


@pytest.mark.parametrize("backend", HOST_BACKENDS)
def test_a_prepared_write_runs_like_the_free_function_and_rebinds_by_name(backend):
    rt = scenarios.runtime_for(kv_canary.generated)
    case = scenarios.make_write_case(random.Random(5), kv_canary.generated, n_reqs=3)
    ours, theirs = scenarios.clone_case(case), scenarios.clone_case(case)
    prepared = rt.bind("launch_canary_write_kernel", **ours, backend=backend)
    prepared()
    rt.launch_canary_write_kernel(**theirs, backend=backend)
    scenarios.compare_state(ours, theirs)
    # The next step's tokens in new tensors: rebound by name, everything else stays bound.
    tokens = theirs["input_ids"] + 1
    again = prepared.rebind(input_ids=tokens.clone())
    assert again is not prepared and again.arguments["context"] is ours["context"]
    again.run()
    rt.launch_canary_write_kernel(**dict(theirs, input_ids=tokens), backend=backend)
    scenarios.compare_state(ours, theirs)


def test_rebind_checks_what_it_is_given():
    rt = scenarios.runtime_for(kv_canary.generated)
    case = scenarios.make_write_case(random.Random(6), kv_canary.generated, n_reqs=2)
    prepared = rt.bind("launch_canary_write_kernel", **case)
    with pytest.raises(TypeError, match=r"^kv-canary: launch_canary_write_kernel has no argument tokens to rebind"):
        prepared.rebind(tokens=case["input_ids"])
    with pytest.raises(TypeError, match=r"^kv-canary: positions must have dtype torch.int64, got torch.int32$"):
        prepared.rebind(positions=case["positions"].int())
    with pytest.raises(ValueError, match=r"^kv-canary: .* has no launch named 'launch_nothing'"):
        rt.bind("launch_nothing")


def test_a_rebind_checks_again_a_context_tensor_moved_after_binding():
    """A prepared launch does not look at its arguments again; rebinding validates the whole launch,
    the frozen context's tensors included: the ring moved into the canary records is refused."""
    rt = scenarios.runtime_for(kv_canary.generated)
    case = scenarios.make_write_case(random.Random(7), kv_canary.generated, n_reqs=2)
    prepared = rt.bind("launch_canary_write_kernel", **case)
    ctx = case["context"]
    row = ctx.violation_ring.shape[1]
    ctx.violation_ring.set_(ctx.canary_buf.untyped_storage(), 0, (1, row), (row, 1))
    with pytest.raises(ValueError, match=r"^kv-canary: (violation_ring|canary_buf) overlaps (canary_buf|violation_ring): "
                                         r"this launch writes both"):
        prepared.rebind(input_ids=case["input_ids"].clone())
