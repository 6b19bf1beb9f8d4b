"""The one binder (kv_canary/backends/binder.py): the bindings it compiles from a tree's typed kernel
ABI give the values a plain reading of the table gives, for every kernel of every schema; what it
refuses, it refuses by name."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch
from support import scenarios

from kv_canary.backends.binder import (
    Int,
    KernelAbi,
    KvTensor,
    OperationRules,
    Ptr,
    RealKv,
    Size,
    Stride,
    parse_path,
    resolve,
)
from kv_canary.launch import operations
from kv_canary.trees.sources import kernel_abi

CASES = {"write": scenarios.make_write_case, "verify": scenarios.make_verify_case,
         "plan": scenarios.make_plan_case, "scatter": scenarios.make_scatter_case}


def _read(path: str, args: dict, optional: bool):
    """A path read step by step (an absent last attribute is None where the source allows it)."""
    p = parse_path(path)
    value = args[p.root]
    for i, attr in enumerate(p.attrs):
        value = getattr(value, attr, None) if optional and i == len(p.attrs) - 1 else getattr(value, attr)
    return value if p.key is None else value[p.key]


def _tensor_value(what: str, t: torch.Tensor) -> int:
    return {"ptr": t.data_ptr(), "row_stride_bytes": t.stride(0) * t.element_size(), "rows": t.shape[0]}[what]


def expected_values(kernel: KernelAbi, args: dict) -> tuple:
    """The kernel's values in ABI order, by reading its table one row at a time."""
    out: list = []
    for entry in kernel.table:
        if isinstance(entry, RealKv):
            sources = resolve(entry.path, args)
            for i in range(entry.sources):
                for _, _, spec in entry.per_source:
                    if i >= len(sources):
                        out.append(0)
                    elif isinstance(spec, KvTensor):
                        out.append(_tensor_value(spec.what, sources[i].tensor))
                    elif spec.fallback:
                        out.append(getattr(sources[i], spec.name, None) or getattr(sources[i], spec.fallback))
                    elif spec.default is not None:
                        out.append(getattr(sources[i], spec.name, spec.default))
                    else:
                        out.append(getattr(sources[i], spec.name))
            out.append(len(sources))
            continue
        _, _, src = entry
        if isinstance(src, Ptr):
            t = _read(src.path, args, src.optional)
            enabled = not src.when or _read(src.when, args, False)
            out.append(t.data_ptr() if enabled and t is not None else 0)
        elif isinstance(src, (Size, Stride)):
            t = _read(src.path, args, src.optional)
            out.append(0 if t is None else t.shape[src.dim] if isinstance(src, Size) else t.stride(src.dim))
        else:
            assert isinstance(src, Int), src
            out.append(int(_read(src.path, args, False)))
    return tuple(out)


def _validated(tree, name: str, seed: int) -> tuple[dict, list]:
    abi = kernel_abi(tree)
    case = CASES[name](random.Random(seed), tree, n_reqs=3)
    keywords = abi.OPERATIONS[name].keywords
    read: list = []
    args = operations.BY_NAME[name].validate(scenarios.runtime_for(tree).validators,
                                             {k: v for k, v in case.items() if k in keywords}, read)
    return args, read


@pytest.mark.parametrize("name", ["write", "verify", "scatter"])
def test_each_kernels_binding_reads_its_table(any_tree, name):
    abi = kernel_abi(any_tree)
    kernel = abi.kernel_for_operation(name)
    assert len(kernel.params) == len(kernel.kinds) == len(expected_values(kernel, _validated(any_tree, name, 0)[0]))
    for seed in range(4):
        args, read = _validated(any_tree, name, seed)
        want = expected_values(kernel, args)
        if kernel.real_kv is not None:
            assert kernel.bind(args, read) == want  # what validation read of the sources
            assert kernel.bind(args, None) == want  # read by the binding itself
        else:
            assert kernel.bind(args) == want


def test_the_plans_stages_read_their_tables(any_tree):
    abi = kernel_abi(any_tree)
    kernels = [abi.kernel_for_operation(stage) for stage in abi.PLAN.stages]
    for seed in range(4):
        args, _ = _validated(any_tree, "plan", seed)
        scratch = torch.zeros(int(args["req_pool_indices"].shape[0]) + 1, dtype=torch.int64)
        stages = abi.PLAN.args(args, scratch)
        assert abi.PLAN.bind(args, scratch) == tuple(expected_values(k, a) for k, a in zip(kernels, stages))


def test_a_checked_integer_is_refused_with_its_kernel_and_parameter(default_tree):
    """launch_tag is read from the context: the binding, not validation, refuses what a long long cannot hold."""
    kernel = kernel_abi(default_tree).kernel_for_operation("verify")
    args, read = _validated(default_tree, "verify", 0)
    paths = [e.path if isinstance(e, RealKv) else e[2].path for e in kernel.table]
    fields = {parse_path(p).attrs[0] for p in paths if parse_path(p).root == "context"}
    ctx = SimpleNamespace(**{f: getattr(args["context"], f, None) for f in fields})
    ctx.kernel_kind = 1 << 63
    with pytest.raises(ValueError, match=r"^kv-canary: kernel canary_verify parameter launch_tag = 9223372036854775808 "
                                         r"does not fit its C type long long \[-9223372036854775808, 9223372036854775807\]$"):
        kernel.bind(dict(args, context=ctx), read)


def test_a_size_in_a_narrower_parameter_is_range_checked():
    kernel = KernelAbi(name="k", operation="op", source="", shape="per_request", threads=1, blocks_per_sm=0,
                       blocks=0, warp_reduction=False, variants=(),
                       table=(("n", "int", Size("x", 0)), ("s", "long long", Stride("x", 0)),
                               ("v", "int", Int("v", checked=True)), ("p", "const long long*", Ptr("x"))))
    x = torch.zeros(3, dtype=torch.int64)
    assert kernel.kinds == ("i32", "i64", "i32", "ptr")
    assert kernel.bind({"x": x, "v": 7}) == (3, 1, 7, x.data_ptr())
    with pytest.raises(ValueError, match=r"parameter v = 2147483648 does not fit its C type int"):
        kernel.bind({"x": x, "v": 1 << 31})
    with pytest.raises(ValueError, match=r"parameter n = 2147483648 does not fit its C type int"):
        kernel.bind({"x": torch.empty(1 << 31, dtype=torch.int8, device="meta"), "v": 0})


@pytest.mark.parametrize("path", ["a.b c", "a.__import__('os')", "a[b]c", "1a", "a.class"])
def test_a_path_that_is_not_names_is_refused(path):
    kernel = KernelAbi(name="k", operation="op", source="", shape="per_request", threads=1, blocks_per_sm=0,
                       blocks=0, warp_reduction=False, variants=(), table=(("p", "const long long*", Ptr(path)),))
    with pytest.raises(ValueError, match="kv-canary: kernel ABI path"):
        kernel.bind  # noqa: B018 (compiling it is what refuses)


def test_a_kernel_takes_one_real_kv_block(default_tree):
    block = kernel_abi(default_tree).REAL_KV
    with pytest.raises(ValueError, match="kv-canary: kernel k lists 2 real-KV blocks; a kernel takes at most one"):
        KernelAbi(name="k", operation="op", source="", shape="per_request", threads=1, blocks_per_sm=0, blocks=0,
                  warp_reduction=False, variants=(), table=(block, block))


def test_an_unknown_c_type_is_refused():
    with pytest.raises(ValueError, match=r"kv-canary: the binder cannot pass C type 'float'"):
        KernelAbi(name="k", operation="op", source="", shape="per_request", threads=1, blocks_per_sm=0, blocks=0,
                  warp_reduction=False, variants=(), table=(("f", "float", Int("f")),))


def test_an_operations_keywords_take_defaults_and_refuse_unknown_names(default_tree):
    rules = kernel_abi(default_tree).OPERATIONS["plan"]
    required = {k: object() for k in rules.keywords if k not in rules.defaults}
    assert rules.arguments(**required) == {k: required.get(k, rules.defaults.get(k)) for k in rules.keywords}
    with pytest.raises(TypeError, match="unexpected keyword argument 'bogus'"):
        rules.arguments(**required, bogus=1)
    with pytest.raises(TypeError, match="missing 1 required keyword-only argument: 'req_to_token'"):
        rules.arguments(**{k: v for k, v in required.items() if k != "req_to_token"})


def test_an_operations_tensors_follow_its_paths():
    rules = OperationRules(name="op", device_of="a", keywords=("o", "m"), defaults={}, tensor_rules=(
        ("o.a", ("a", "int64", (None,), "input", False, True, 0, "", "a")),
        ("o.gone", ("gone", "int64", (None,), "input", True, True, 0, "", "gone")),
        ("m[k]", ("m['k']", "int64", (None,), "input", False, True, 0, "", "m['k']")),
    ))
    o = type("O", (), {"a": 1})()
    assert rules.tensors({"o": o, "m": {"k": 2}}) == (1, None, 2)  # an optional attribute may be absent
    with pytest.raises(AttributeError):
        OperationRules(name="op", device_of="a", keywords=("o",), defaults={},
                       tensor_rules=(("o.gone", ("gone", "int64", (None,), "input", False, True, 0, "", "gone")),)
                       ).tensors({"o": o})
