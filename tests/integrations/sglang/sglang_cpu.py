"""SGLang's own canary runtime (`sglang.srt.kv_canary`, sglang==0.5.23) on the CPU, with as few
stand-ins as it takes to import and run it without a GPU or the whole server.

`install()` must run before anything under `sglang` is imported. Every stand-in is in STUBS with its
reason; everything else (the CanaryManager, SingleForwardManager, endpoints, plan inputs, the
violation manager and reporter, health checker, stats logger, sweep, perturb modules, the pool
attachers, the hook registry and plugin loader) is SGLang's own code.
"""
from __future__ import annotations

import importlib.util
import sys
import types
from array import array

import torch

SGLANG_VERSION = "0.5.23"

# module (or module attribute) -> why it is replaced; tests/integrations/sglang/test_sglang_plugin.py
# checks that each stand-in install() makes is named here.
STUBS = {
    "sglang (package __init__)": "imports the whole server (engine, HTTP API, model registry); the canary "
                                 "runtime needs none of it, so the package is entered without running it",
    "triton, triton.language": "Triton kernels need a GPU (and the triton wheel): the launchers reach them "
                               "only for CUDA tensors; on the CPU they run their torch references",
    "sglang.kernels.jit.utils": "the CUDA JIT loader (tvm-ffi + nvcc); only reached for CUDA tensors",
    "sglang.srt.utils (package __init__), sglang.srt.utils.common":
        "utils/common.py imports the server's stack (HTTP, PIL, psutil, triton); the stand-in holds the "
        "four functions the canary runtime calls, with SGLang's CPU behaviour",
    "sglang.srt.utils.phase_checker._phase_check_kernel": "a Triton kernel (the phase state machine); "
                                                          "replaced by the same state machine on the host",
    "pinned host memory (torch.empty/zeros/tensor pin_memory=True in future_tensor, "
    "req_to_expected_token_ids_manager)": "pinned memory needs an accelerator; the copies are plain CPU copies",
    "sglang.srt.mem_cache.unified_radix_cache.UnifiedRadixCache": "the radix cache imports the cache "
        "controller, HiCache and scheduler types; the sweep and the unused-cache perturb only walk it "
        "(tree_core.walk_for_kv_canary), so a list of cached slot chains stands in",
    "ForwardBatch / ForwardMode (model_executor.forward_batch_info)": "imports attention kernels and the "
        "distributed stack; a namespace with the fields the canary reads stands in, as in SGLang's own "
        "test fixtures (sglang/test/kv_canary/fixtures.py)",
    "ModelRunner, ServerArgs, install_canary": "the harness builds CanaryManager directly from "
        "CanaryConfig / PerturbConfig / CanaryLaunchCapacities, as SGLang's runner tests do; "
        "install_canary reads ServerArgs and the ModelRunner",
    "launch_scatter_req_token_ids_kernel (SGLang provider only)": "Triton only, with no torch fallback: "
        "SGLang's side scatters through its test reference "
        "sglang.test.kernels.kv_canary.scatter_req_token_ids_reference",
}

_installed = False


def _package(name: str, path: list[str] | None = None) -> types.ModuleType:
    module = types.ModuleType(name)
    if path is not None:
        module.__path__ = path
    sys.modules[name] = module
    return module


def _sglang_dir() -> str:
    spec = importlib.util.find_spec("sglang")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError("sglang is not installed (make setup installs sglang==%s)" % SGLANG_VERSION)
    return list(spec.submodule_search_locations)[0]


class _TritonKernel:
    def __init__(self, fn):
        self.fn = fn

    def __getitem__(self, grid):
        raise RuntimeError(f"Triton kernel {self.fn.__name__} cannot run on the CPU (stubbed triton)")


def _stub_triton() -> None:
    triton = _package("triton", [])
    language = _package("triton.language", [])

    def jit(fn=None, **_options):
        return _TritonKernel(fn) if fn is not None else (lambda f: _TritonKernel(f))

    triton.jit = jit
    triton.cdiv = lambda a, b: -(-a // b)
    triton.language = language
    language.constexpr = object
    for name in ("int1", "int8", "int32", "int64", "uint8"):
        setattr(language, name, name)


def _stub_jit_loader(root: str) -> None:
    jit_utils = _package("sglang.kernels.jit.utils", [root + "/kernels/jit/utils"])

    def load_jit(*_args, **_kwargs):
        raise RuntimeError("the CUDA JIT loader cannot run on the CPU (stubbed)")

    jit_utils.cache_once = lambda fn: fn
    jit_utils.load_jit = load_jit
    jit_utils.make_cpp_args = lambda *args: ", ".join(str(a).lower() for a in args)


def _stub_srt_utils(root: str) -> None:
    utils = _package("sglang.srt.utils", [root + "/srt/utils"])
    common = _package("sglang.srt.utils.common")

    def create_device_stream(device):
        device = torch.device(device)
        module = torch.get_device_module(device)
        return module.Stream() if device.type == "cpu" else module.Stream(device=device)

    def is_device_stream_capturing(device) -> bool:
        return False   # SGLang's answer for the CPU

    def get_device(device_id=None) -> str:
        return "cpu"

    def flatten_arrays_to_int64_tensor(parts, device, pin: bool) -> torch.Tensor:
        flat = array("q")
        for part in parts:
            flat.extend(part)
        return torch.tensor(list(flat), dtype=torch.int64).to(device)

    for module in (utils, common):
        module.create_device_stream = create_device_stream
        module.is_device_stream_capturing = is_device_stream_capturing
        module.get_device = get_device
        module.flatten_arrays_to_int64_tensor = flatten_arrays_to_int64_tensor
    utils.common = common


class _HostPhaseCheck:
    """SimplePhaseChecker's Triton kernel as host code: assert the phase (when enabled), store the next."""

    def __getitem__(self, grid):
        def run(phase, enable_assert, *, EXPECT_PHASE, NEXT_PHASE, CALLER_TAG):
            if int(enable_assert[0]) != 0 and int(phase) != EXPECT_PHASE:
                raise AssertionError(f"SimplePhaseChecker: phase mismatch (caller_tag={CALLER_TAG} "
                                     f"expect={EXPECT_PHASE} actual={int(phase)})")
            phase.fill_(NEXT_PHASE)
        return run


class _TorchWithoutPinning(types.ModuleType):
    """`torch` for the modules that allocate pinned host memory: the same, with pin_memory dropped."""

    def __init__(self):
        super().__init__("torch")

    def __getattr__(self, name):
        value = getattr(torch, name)
        if name in ("empty", "zeros", "tensor"):
            def unpinned(*args, pin_memory=False, **kwargs):
                return value(*args, **kwargs)
            return unpinned
        return value


class RadixCacheStandIn:
    """Stands in for UnifiedRadixCache: cached slot chains, walked as SGLang's tree core walks them."""

    def __init__(self, req_to_token_pool):
        self.req_to_token_pool = req_to_token_pool
        self.chains: list[list[int]] = []
        self.tree_core = self

    def walk_for_kv_canary(self, *, unlocked_only: bool = False, swa_resident_only: bool = False):
        from sglang.srt.mem_cache.unified_cache.unified_tree_core_interface import RadixCacheWalkResult

        slots, positions, prevs = [], [], []
        for chain in self.chains:
            for pos, slot in enumerate(chain):
                slots.append(slot)
                positions.append(pos)
                prevs.append(chain[pos - 1] if pos > 0 else -1)
        as_tensor = lambda xs: torch.tensor(xs, dtype=torch.int64)  # noqa: E731
        return RadixCacheWalkResult(slot_indices=as_tensor(slots), positions=as_tensor(positions),
                                    prev_slot_indices=as_tensor(prevs))


def install() -> None:
    """Enter the sglang package with the stand-ins above; idempotent."""
    global _installed
    if _installed:
        return
    if "sglang" in sys.modules:
        raise RuntimeError("sglang_cpu.install() must run before sglang is imported")
    root = _sglang_dir()
    _package("sglang", [root])
    _stub_triton()
    _stub_jit_loader(root)
    _stub_srt_utils(root)
    radix = _package("sglang.srt.mem_cache.unified_radix_cache")
    radix.UnifiedRadixCache = RadixCacheStandIn

    from sglang.srt.utils import phase_checker
    phase_checker._phase_check_kernel = _HostPhaseCheck()
    from sglang.srt.kv_canary import req_to_expected_token_ids_manager
    from sglang.srt.kv_canary.runner import future_tensor
    for module in (future_tensor, req_to_expected_token_ids_manager):
        module.torch = _TorchWithoutPinning()
    _installed = True


class ForwardMode:
    """The ForwardMode members the canary runtime asks about (model_executor.forward_batch_info)."""

    def __init__(self, name: str):
        self.name = name

    def is_decode_or_idle(self):
        return self.name in ("DECODE", "IDLE")

    def is_decode(self):
        return self.name == "DECODE"

    def is_target_verify(self):
        return False

    def is_draft_extend_v2(self):
        return False

    def is_extend(self, include_draft_extend_v2: bool = False):
        return self.name == "EXTEND"

    def __repr__(self):
        return f"ForwardMode.{self.name}"


EXTEND = ForwardMode("EXTEND")
DECODE = ForwardMode("DECODE")
