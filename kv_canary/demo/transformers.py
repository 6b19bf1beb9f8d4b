"""The demo on a real engine: HF transformers' continuous batching (a tiny random Llama, paged KV
cache) guarded by kv_canary.integrations.transformers, and faults injected through the engine's
own objects (its allocator's pool and block tables, its ledger, its cache tensor, its IO tensors).

Each scenario states which canary check must fire (launch tag, fail reason) at which step, or, for
a control, that the canary stays silent; `damage_step` is the step in (or after) which the fault
did its damage, the expected first detection `damage_step + expect.delay`. Faults that act after a
step's update damage what the next step reads (delay 1).
"""
from __future__ import annotations

import gc
import logging
import random
from dataclasses import dataclass, field
from typing import Callable, Optional

from ..engine.manager import CanaryManager
from .faults import Expect, ScenarioResult, judge

INSTALL_HINT = "pip install 'kv-canary[transformers]'"
PAGE_SIZE = 4
SWEEP = 4
STATS_EVERY = 10   # the demo's stats line cadence on this engine's ~30-step run


def available() -> Optional[str]:
    """None when transformers can run the section, else why not (with how to get it)."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        return f"HF transformers is not installed: {INSTALL_HINT} (or `make setup`)"
    try:
        from ..integrations.transformers import check_hook_points
        check_hook_points()
    except RuntimeError as e:
        return str(e)
    return None


# -- the workload -------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    num_requests: int = 8
    max_new_tokens: int = 10
    shared_prefix: int = 9         # every other prompt starts with the same 9 tokens (prefix sharing)
    num_blocks: int = 48
    max_batch_tokens: int = 32     # longer prompts are prefilled in chunks
    max_requests_per_batch: int = 3
    block_sharing: bool = True
    seed: int = 0

    def prompts(self) -> list[list[int]]:
        rng = random.Random(self.seed)
        shared = [rng.randrange(1, 256) for _ in range(self.shared_prefix)]
        out = []
        for i in range(self.num_requests):
            if i % 2 == 0:
                out.append(shared + [rng.randrange(1, 256) for _ in range(rng.randint(2, 14))])
            else:
                out.append([rng.randrange(1, 256) for _ in range(rng.randint(6, 26))])
        return out

    def configs(self):
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig
        gen = GenerationConfig(max_new_tokens=self.max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0)
        cb = ContinuousBatchingConfig(num_blocks=self.num_blocks, page_size=PAGE_SIZE,
                                      max_batch_tokens=self.max_batch_tokens,
                                      max_requests_per_batch=self.max_requests_per_batch,
                                      allow_block_sharing=self.block_sharing)
        return gen, cb


WORKLOAD = Workload()
NO_SHARING = Workload(block_sharing=False)

_MODEL = None


def model():
    """The tiny random Llama (built once per process)."""
    global _MODEL
    if _MODEL is None:
        from ..integrations.transformers import tiny_llama
        logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)  # its CPU memory notes
        _MODEL = tiny_llama()
    return _MODEL


def run(manager: CanaryManager, workload: Workload = WORKLOAD, hooks=()):
    """One guarded generate_batch; returns (canary handle, outputs)."""
    return run_with(manager, workload, hooks)


def run_with(manager: CanaryManager, workload: Workload = WORKLOAD, hooks=(), **attach_options):
    """`run` with attach's other options (request_inputs for a schema with request_input fields)."""
    from ..integrations.transformers import attach
    m = model()
    canary = attach(m, manager, hooks=hooks, **attach_options)
    try:
        outputs = generate(m, workload)
    finally:
        canary.detach()
    return canary, outputs


def generate(m, workload: Workload = WORKLOAD):
    """model.generate_batch over the workload. Its run ends with two full gc.collect() calls, which walk
    every object of the process (torch's and transformers' modules: ~0.5 s here): what exists before
    the run is frozen out of their way (gc.freeze) for its duration."""
    gen, cb = workload.configs()
    gc.freeze()
    try:
        return m.generate_batch(workload.prompts(), generation_config=gen, continuous_batching_config=cb)
    finally:
        gc.unfreeze()


# -- faults -------------------------------------------------------------------------------------
class Fault:
    def __init__(self):
        self.damage_step: Optional[int] = None
        self.detail = ""

    def hit(self, step: int, detail: str) -> None:
        self.damage_step = step
        self.detail = detail

    @property
    def fired(self) -> bool:
        return self.damage_step is not None


def _decoding(engine, min_left: int = 3, min_blocks: int = 2):
    """Requests past their prefill with a few tokens left and at least `min_blocks` complete blocks."""
    out = []
    for req in engine.requests.values():
        st = req.state
        blocks = engine.alloc.block_table.get(req.request_id, [])
        complete = (len(st.initial_tokens) + len(st.generated_tokens) - 1) // engine.block_size
        if st.generated_tokens and st.max_new_tokens - len(st.generated_tokens) >= min_left \
                and complete >= min_blocks and len(blocks) >= min_blocks:
            out.append(req)
    return out


class BlockFreedWhileReferenced(Fault):
    """A refcount bug: the pool takes back a block a running request still reads (pool.free_blocks),
    and the allocator hands it to another request, which writes its own tokens there.

    reuse=False (the control): freed when no other request will allocate again, so the block is never
    handed out and nothing the request reads changes."""

    def __init__(self, reuse: bool = True):
        super().__init__()
        self.reuse = reuse
        self.victim = None

    def after_update(self, engine) -> None:
        if self.victim is not None:
            return
        sched = engine.processor.scheduler
        for req in _decoding(engine, min_left=3 if self.reuse else 1):
            blocks = engine.alloc.block_table[req.request_id]
            st = req.state
            alone = not sched.waiting_requests and len(sched.active_requests) == 1 \
                and len(blocks) * engine.block_size >= len(st.initial_tokens) + st.max_new_tokens - 1
            if self.reuse == alone or not (self.reuse or alone):
                continue
            block = blocks[0]
            if block in engine.alloc.ledger.shared_ref_counts:
                continue
            engine.alloc.pool.free_blocks(engine.alloc.index, [block])
            self.victim, self.block = req, block
            if not self.reuse:
                self.hit(engine.step, f"block {block} of {req.request_id} freed while referenced; no other "
                                      f"request allocates again")
            return

    def before_step(self, engine) -> None:
        if self.victim is None or self.fired:
            return
        for rid, blocks in engine.alloc.block_table.items():
            if rid != self.victim.request_id and self.block in blocks:
                self.hit(engine.step, f"block {self.block} (slots {self.block * engine.block_size}..) freed while "
                                      f"{self.victim.request_id} reads it, handed to {rid}")
                return


class CorruptBlockTableEntry(Fault):
    """A request's block-table entry is overwritten with another request's block (a stale or
    miscomputed entry): the next step reads the other block's K/V as its own prefix.

    identical=True (the control): the other block holds the same tokens at the same positions (what
    the engine's own de-duplication does on purpose): nothing the request reads changes."""

    def __init__(self, identical: bool = False):
        super().__init__()
        self.identical = identical

    def after_update(self, engine) -> None:
        if self.fired:
            return
        tables = engine.alloc.block_table
        for a in _decoding(engine):
            ta = tables[a.request_id]
            toks_a = list(a.state.initial_tokens[:engine.block_size])
            for b in engine.requests.values():
                tb = tables.get(b.request_id, [])
                if b is a or not tb or tb[0] == ta[0] or b.state.position_offset < engine.block_size:
                    continue
                same = list(b.state.initial_tokens[:engine.block_size]) == toks_a
                if same == self.identical:
                    old, ta[0] = ta[0], tb[0]
                    if same:  # done right, as de-duplication does it: the new block gains a reference
                        ledger = engine.alloc.ledger
                        ledger.acquire(tb[0])
                        if ledger.release(old):
                            engine.alloc.pool.free_blocks(engine.alloc.index, [old])
                    what = "the same tokens" if same else "other tokens"
                    return self.hit(engine.step, f"{a.request_id} block-table entry 0: block {old} -> block {tb[0]} "
                                                 f"of {b.request_id} ({what})")


class KvBytesChanged(Fault):
    """One byte of a running request's K (layer 0, its first slot) changes after the slot was
    fingerprinted (a stray write into the cache tensor). The byte lies past the first 16 bytes of
    the slot, so the PARTIAL fingerprint (the control) does not read it."""
    BYTE = 32
    MASK = 0x10

    def after_update(self, engine) -> None:
        if self.fired:
            return
        for req in _decoding(engine):
            block = engine.alloc.block_table[req.request_id][0]
            engine.storage.k[0][block, self.BYTE] ^= self.MASK   # the cache tensor itself (a view of it)
            return self.hit(engine.step, f"K byte {self.BYTE} of slot {block * engine.block_size} (layer 0) of "
                                         f"{req.request_id} flipped")


class PositionOffByOne(Fault):
    """A decode step's position is one too high in the engine's IO (`position_ids`).

    model_only=True (the control): the change lands after the canary read the step's inputs, so only
    the model sees it; the canary checks the slot bookkeeping it is given, not the model's inputs."""

    def __init__(self, model_only: bool = False):
        super().__init__()
        self.model_only = model_only

    def _edit(self, engine) -> None:
        if self.fired:
            return
        io = engine.processor.inputs_and_outputs
        offset = 0
        for fs in io.requests_in_batch:
            if fs.query_length == 1 and fs.state.generated_tokens and engine.step >= 3:
                io.position_ids[offset] += 1
                return self.hit(engine.step, f"{fs.state.request_id}: decode position "
                                             f"{fs.state.position_offset - 1} given as {fs.state.position_offset}")
            offset += fs.query_length

    def before_step(self, engine) -> None:
        if not self.model_only:
            self._edit(engine)

    def before_forward(self, engine, batch) -> None:
        if self.model_only:
            self._edit(engine)


class WrongTokenForCachedBlock(Fault):
    """The prefix cache maps a waiting prompt's first block to a cached block that holds other tokens
    (a wrong ledger entry: `hash_to_block`), so the request reads K/V of tokens it never had. Chain,
    positions and K/V bytes are all self-consistent: only the expected-token check sees it."""

    def __init__(self):
        super().__init__()
        self.target: Optional[tuple] = None   # (request id, block)

    def after_update(self, engine) -> None:
        from transformers.generation.continuous_batching.cache_allocators.cache_allocator import compute_block_hash
        if self.target is not None:
            return
        ledger, bs = engine.alloc.ledger, engine.block_size
        cached = [b for b in ledger.cached_blocks if b in engine._meta and engine._meta[b].first_position == 0]
        for rid, state in engine.processor.scheduler.waiting_requests.items():
            prompt = list(state.initial_tokens)
            if len(prompt) <= bs + 1:
                continue
            for block in cached:
                if engine._meta[block].tokens != prompt[:bs]:
                    ledger.hash_to_block[compute_block_hash(None, prompt[:bs])] = block
                    self.target = (rid, block)
                    return

    def before_step(self, engine) -> None:
        if self.target is None or self.fired:
            return
        rid, block = self.target
        if engine.alloc.block_table.get(rid, [None])[0] == block:
            self.hit(engine.step, f"{rid} reads cached block {block} as its first prompt block (other tokens)")


# -- scenarios ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class TransformersScenario:
    name: str
    title: str
    make_fault: Callable[[], Fault]
    expect: Expect
    workload: Workload = WORKLOAD
    manager: dict = field(default_factory=dict)
    steps: int = 40               # the chart's x range (a run takes what its workload needs)
    tree: str = "default"


PREFIX = "transformers/"


def scenarios() -> list[TransformersScenario]:
    P = PREFIX
    return [
        TransformersScenario(P + "block_freed_while_referenced", "the pool takes back a block a request still reads "
                             "and hands it to another request", BlockFreedWhileReferenced,
                             Expect(("tail", "k", "full"), "VERIFY_CHAIN_HASH_MISMATCH")),
        TransformersScenario(P + "block_freed_while_referenced/control", "same bug, but no request allocates again: "
                             "the block is never reused", lambda: BlockFreedWhileReferenced(reuse=False), Expect(None)),
        TransformersScenario(P + "corrupt_block_table_entry", "a block-table entry points at another request's block",
                             CorruptBlockTableEntry, Expect(("head", "k", "full"), "VERIFY_CHAIN_HASH_MISMATCH", 1)),
        TransformersScenario(P + "corrupt_block_table_entry/control", "the entry points at a block with the same "
                             "tokens (what de-duplication does)", lambda: CorruptBlockTableEntry(identical=True),
                             Expect(None), NO_SHARING),
        TransformersScenario(P + "kv_bytes_changed", "a K byte of a cached slot changes after it was fingerprinted",
                             KvBytesChanged, Expect(("head", "k", "full"), "VERIFY_REAL_KV_HASH_MISMATCH", 1)),
        TransformersScenario(P + "kv_bytes_changed/control", "same damage, PARTIAL fingerprint (first 16 bytes)",
                             KvBytesChanged, Expect(None), manager={"real_kv_hash_mode": "PARTIAL"}),
        TransformersScenario(P + "position_off_by_one", "a decode step's position is one too high",
                             PositionOffByOne, Expect(("head", "k", "full"), "WRITE_POSITION_MISMATCH")),
        TransformersScenario(P + "position_off_by_one/control", "same edit after the canary read the inputs (only "
                             "the model sees it)", lambda: PositionOffByOne(model_only=True), Expect(None)),
        TransformersScenario(P + "wrong_token_for_cached_block", "the prefix cache hands a prompt a cached block "
                             "with other tokens", WrongTokenForCachedBlock,
                             Expect(("head", "k", "full"), "VERIFY_TOKEN_MISMATCH")),
        TransformersScenario(P + "wrong_token_for_cached_block/control", "same bug, expected-token check off",
                             WrongTokenForCachedBlock, Expect(None), manager={"check_verify_expected_token": False}),
    ]


def run_scenario(sc: TransformersScenario, *, backend: Optional[str] = None, metrics_registry=None,
                 violations_jsonl=None, **manager_kwargs) -> ScenarioResult:
    """Run one scenario (mode 'log', its own manager) and judge it against its expectation."""
    from .faults import scenario_listeners
    kwargs = {"mode": "log", "sweep_interval": SWEEP, **sc.manager, **manager_kwargs}
    manager = CanaryManager(backend=backend, **kwargs)
    # Before the run: the adapter attaches the manager when the run starts, and the listeners follow.
    listeners = scenario_listeners(manager, sc.name, metrics_registry, violations_jsonl)
    fault = sc.make_fault()
    canary, _ = run(manager, sc.workload, hooks=[fault])
    for x in listeners:
        x.close()
    canary.check()
    return judge(sc, manager, fault)


def run_clean(*, backend: Optional[str] = None, metrics_registry=None, violations_jsonl=None, **manager_kwargs):
    """A fault-free guarded run; returns (canary handle, outputs)."""
    from .faults import scenario_listeners
    kwargs = {"mode": "log", "sweep_interval": SWEEP, **manager_kwargs}
    manager = CanaryManager(backend=backend, **kwargs)
    listeners = scenario_listeners(manager, PREFIX + "clean", metrics_registry, violations_jsonl)
    canary, outputs = run(manager)
    for x in listeners:
        x.close()
    return canary, outputs
