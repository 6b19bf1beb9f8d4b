"""kv-canary on HF transformers' continuous batching (`model.generate_batch`, paged KV cache).

One call attaches a CanaryManager to a model's continuous-batching runs::

    from kv_canary.integrations.transformers import attach
    canary = attach(model)                       # or attach(model, CanaryManager.from_config(config))
    outputs = model.generate_batch(prompts, generation_config=..., continuous_batching_config=...)
    canary.check()                               # raises what the canary raised in the generation thread
    print(canary.manager.stats.total, "violations")

Every run (`generate_batch`, `continuous_batching_context_manager`, `init_continuous_batching`) of
that model is then guarded: per engine step, after the scheduler prepared the batch, the canary
plans from the full-attention allocator's block tables and the IO's slot indices, runs HEAD verify +
write before the forward and TAIL verify + write (real-K/V fingerprints of the paged cache's own K
and V tensors) after it, checks each request's prompt and generated ids as expected tokens, and
every `sweep_interval` steps sweeps the blocks the ledger keeps for reuse. `canary.detach()` undoes it.

The hooks wrap, on the model's own objects only (no class of transformers is changed, no file
edited): `model.init_continuous_batching`, the ContinuousBatchingManager's `_create_batch_processor`
and `_run_generation_loop`, the ContinuousBatchProcessor's `_generation_step` and `update_batch`,
and the PagedAttentionCache's `free_blocks`. `attach` checks that the installed transformers has
each of them and fails at once, naming the version, when it does not. Tested with transformers
`TESTED_VERSIONS` (`pip install 'kv-canary[transformers]'`).

Not covered (a clear error at run start): asynchronous batching (`use_async_batching`), CPU offload
of requests (`cpu_offload_space > 0`: the canary records would not travel with the K/V) and forked
requests (`num_return_sequences > 1`). Sliding-window layers are not guarded (CanaryCoverageWarning).
"""
from __future__ import annotations

import importlib
import warnings
from typing import Callable, Optional

from ...engine.manager import CanaryManager
from .engine import Batch, PagedKvStorage, TransformersEngine

__all__ = ("attach", "TransformersCanary", "TransformersEngine", "PagedKvStorage", "Batch", "TESTED_VERSIONS",
           "tiny_llama")

TESTED_VERSIONS = ">=5.23.0,<5.24"
_TESTED = ((5, 23), (5, 24))

# (module, class, attribute) the hooks need; missing any of them fails attach naming the version.
HOOK_POINTS = (
    ("transformers.generation.continuous_batching.continuous_api", "ContinuousMixin", "init_continuous_batching"),
    ("transformers.generation.continuous_batching.continuous_api", "ContinuousBatchingManager",
     "_create_batch_processor"),
    ("transformers.generation.continuous_batching.continuous_api", "ContinuousBatchingManager",
     "_run_generation_loop"),
    ("transformers.generation.continuous_batching.continuous_api", "ContinuousBatchProcessor", "_generation_step"),
    ("transformers.generation.continuous_batching.continuous_api", "ContinuousBatchProcessor", "update_batch"),
    ("transformers.generation.continuous_batching.cache", "PagedAttentionCache", "free_blocks"),
    ("transformers.generation.continuous_batching.cache", "PagedAttentionCache", "extend_read_and_write_indices"),
    ("transformers.generation.continuous_batching.cache_allocators", "FullAttentionCacheAllocator",
     "get_write_indices"),
    ("transformers.generation.continuous_batching.input_outputs", "ContinuousBatchingIOs", "prepare_batch_tensors"),
)
_MARK = "_kv_canary_attachment"


def _version() -> str:
    try:
        import transformers
    except ImportError as e:
        raise ImportError("kv-canary: kv_canary.integrations.transformers needs HF transformers "
                          f"{TESTED_VERSIONS}: pip install 'kv-canary[transformers]'") from e
    return transformers.__version__


def check_hook_points() -> str:
    """The installed transformers version, after checking it has every hook point (else a RuntimeError
    naming the version and what is missing); a version outside TESTED_VERSIONS only warns."""
    version = _version()
    missing = []
    for module, cls, attr in HOOK_POINTS:
        try:
            owner = getattr(importlib.import_module(module), cls)
        except (ImportError, AttributeError):
            missing.append(f"{module}.{cls}")
            continue
        if not hasattr(owner, attr):
            missing.append(f"{cls}.{attr}")
    if missing:
        raise RuntimeError(f"kv-canary: transformers {version} lacks what the canary hooks into ({', '.join(missing)}); "
                           f"kv_canary.integrations.transformers is tested with transformers {TESTED_VERSIONS}: "
                           f"pip install 'kv-canary[transformers]'")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if not _TESTED[0] <= parts < _TESTED[1]:
        warnings.warn(f"kv-canary: transformers {version} is outside the tested range {TESTED_VERSIONS}; the hook "
                      f"points exist, but their behaviour was not checked", UserWarning, stacklevel=3)
    return version


class TransformersCanary:
    """What `attach` returns: the manager, the current run's engine, and the hooks (`detach`).

    `hooks`: objects with any of `before_step(engine)` (the engine prepared the step's inputs; the
    canary has not read them yet), `before_forward(engine, batch)` (after HEAD) and
    `after_update(engine)` (the engine sampled and released finished requests), called in the
    generation thread (fault injection in tests and the demo, or an engine's own instrumentation)."""

    def __init__(self, model, manager: CanaryManager, *, max_requests: Optional[int], max_context: Optional[int],
                 hooks=()):
        self.model = model
        self.manager = manager
        self.max_requests = max_requests
        self.max_context = max_context
        self.hooks = list(hooks)
        self.engine: Optional[TransformersEngine] = None
        self.runs = 0                 # continuous-batching runs attached so far
        self.steps = 0                # engine steps guarded so far (the manager's step numbers)
        self.errors: list[BaseException] = []   # raised by the canary inside the generation thread
        self._patched: list = []                 # (object, attribute) of every hook installed, for detach
        self.version = check_hook_points()

    # -- the hooks, each wrapping one object of the model's run -----------------------------------
    def _wrap_init(self, original):
        def init_continuous_batching(*args, **kwargs):
            cbm = original(*args, **kwargs)
            self._refuse_unsupported(cbm)
            if not getattr(cbm, _MARK, None):
                self._patch(cbm, _MARK, self)
                self._patch(cbm, "_create_batch_processor", self._wrap_create(cbm._create_batch_processor))
                self._patch(cbm, "_run_generation_loop", self._wrap_loop(cbm._run_generation_loop))
            return cbm
        return init_continuous_batching

    def _refuse_unsupported(self, cbm) -> None:
        cb = cbm.continuous_batching_config
        problems = []
        if cb.use_async_batching:
            problems.append("use_async_batching=True (the inputs of step N+1 are prepared before step N's tokens "
                            "are known)")
        if (cb.cpu_offload_space or 0) > 0:
            problems.append(f"cpu_offload_space={cb.cpu_offload_space} (the canary records of offloaded requests do "
                            f"not travel with their K/V)")
        if (cbm.num_return_sequences or 1) > 1:
            problems.append(f"num_return_sequences={cbm.num_return_sequences} (forked requests copy blocks without "
                            f"their canary records)")
        if problems:
            raise ValueError("kv-canary: the transformers canary does not support " + "; ".join(problems)
                             + "; detach() it or change the ContinuousBatchingConfig / GenerationConfig")

    def _wrap_create(self, original):
        def _create_batch_processor():
            processor = original()
            if getattr(processor, _MARK, None) is self and self.engine is not None:
                self.engine.reset()       # a persistent manager's processor, reset for a new session
                return processor
            self._patch(processor, _MARK, self)
            engine = TransformersEngine(processor, max_requests=self.max_requests, max_context=self.max_context)
            self.manager.attach(engine)
            engine.canary = self.manager if self.manager.enabled else None
            self.engine = engine
            self.runs += 1
            self._patch(processor, "_generation_step", self._wrap_step(processor._generation_step))
            self._patch(processor, "update_batch", self._wrap_update(processor.update_batch))
            self._patch(processor.cache, "free_blocks", self._wrap_free(processor.cache.free_blocks))
            return processor
        return _create_batch_processor

    def _patch(self, obj, name: str, value) -> None:
        """Set an instance attribute of one of the run's objects (its class stays untouched)."""
        obj.__dict__[name] = value
        self._patched.append((obj, name))

    def _guarded(self, fn):
        """Run a hook body; what it raises is kept for `check()` (the generation thread swallows it)."""
        try:
            return fn()
        except BaseException as e:
            self.errors.append(e)
            raise

    def _wrap_step(self, original):
        def _generation_step(model):
            engine, manager = self.engine, self.manager
            if not manager.enabled:
                return original(model)
            engine.step = self.steps
            self._call("before_step", engine)
            batch = self._guarded(lambda: engine.batch(self.steps))
            self._guarded(lambda: manager.head(batch))
            self._call("before_forward", engine, batch)
            original(model)
            self._guarded(lambda: manager.tail(batch))
            engine.last_batch = batch
        return _generation_step

    def _wrap_update(self, original):
        def update_batch():
            original()
            engine = self.engine
            self._guarded(engine.after_update)
            self._call("after_update", engine)
            step, self.steps = self.steps, self.steps + 1
            self._guarded(lambda: self.manager.after_step(step))
        return update_batch

    def _wrap_free(self, original):
        def free_blocks(request_id, no_cache=False):
            self._guarded(lambda: self.engine.on_free(request_id))
            return original(request_id, no_cache)
        return free_blocks

    def _wrap_loop(self, original):
        def _run_generation_loop():
            try:
                original()
            finally:
                try:
                    self.manager.flush()   # the last steps' rows and totals (listeners), before the thread ends
                except BaseException as e:
                    self.errors.append(e)
        return _run_generation_loop

    def _call(self, name: str, *args) -> None:
        for hook in self.hooks:
            fn = getattr(hook, name, None)
            if fn is not None:
                fn(*args)

    # -- for the caller ----------------------------------------------------------------------------
    def check(self) -> None:
        """Raise the first error the canary raised inside the generation thread (mode `raise`'s
        CanaryViolationError, a CanaryHealthError, a capacity error), if any."""
        if self.errors:
            raise self.errors[0]

    def detach(self) -> None:
        """Remove every hook (the model's, and those of a persistent manager it keeps for its next
        runs); call it between runs, not during one."""
        self.model.__dict__.pop("init_continuous_batching", None)
        self.model.__dict__.pop(_MARK, None)
        for obj, name in reversed(self._patched):
            obj.__dict__.pop(name, None)
        self._patched.clear()


def attach(model, manager: Optional[CanaryManager] = None, *, max_requests: Optional[int] = None,
           max_context: Optional[int] = None, request_inputs: Optional[Callable] = None,
           hooks=()) -> TransformersCanary:
    """Guard every continuous-batching run of `model` (a transformers model with `generate_batch`).

    manager: the CanaryManager (default: `CanaryManager()`, every check on; `CanaryManager.from_config`
    for SGLang's flags and defaults). It is attached to each run's paged cache when the run starts.
    max_requests: requests that may hold KV cache at once (default: twice max_requests_per_batch): the
    rows of the canary's per-request tables;
    max_context: tokens one request may hold (default: the whole cache): an upper bound only, the
    tables' columns grow on demand to the longest request (docs/attach-your-engine.md, "What the
    canary costs").
    request_inputs: for a schema with request_input fields (kv_canary/schemas/isolation.yaml), the
    function transformers' RequestState -> {field: int} (e.g. `namespace_inputs(lambda state: ...)` of
    kv_canary.engine.request_inputs); a schema with such a field and no function is refused here.
    """
    if getattr(model, _MARK, None) is not None:
        raise ValueError("kv-canary: this model already has a canary attached; detach() it first")
    if not callable(getattr(model, "init_continuous_batching", None)):
        raise ValueError(f"kv-canary: attach needs a transformers model with continuous batching "
                         f"(init_continuous_batching / generate_batch), got {type(model).__name__}")
    manager = manager if manager is not None else CanaryManager()
    if request_inputs is not None:
        if manager.request_inputs is not None:
            raise ValueError("kv-canary: give request_inputs to attach or to the CanaryManager, not both")
        if not callable(request_inputs):
            raise ValueError(f"kv-canary: attach's request_inputs must be a function RequestState -> "
                             f"{{field: int}}, got {request_inputs!r}")
        manager.request_inputs = lambda request: request_inputs(request.state)  # the adapter's row -> its state
    manager.check_request_inputs()
    canary = TransformersCanary(model, manager, max_requests=max_requests, max_context=max_context, hooks=hooks)
    model.__dict__[_MARK] = canary
    model.__dict__["init_continuous_batching"] = canary._wrap_init(model.init_continuous_batching)
    return canary


def tiny_llama(*, seed: int = 0, num_layers: int = 2, hidden: int = 64, vocab: int = 256):
    """A tiny randomly initialised Llama built from a config (no weights or tokenizer downloaded): the
    model the demo, the tests and the benchmark drive."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                         num_hidden_layers=num_layers, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=512, attn_implementation="sdpa")
    torch.manual_seed(seed)
    return LlamaForCausalLM(config).eval()
