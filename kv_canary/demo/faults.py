"""Named, seeded fault-injection scenarios: each injects one real serving bug into the simulation
and states which canary check must fire (launch tag, fail reason) and at which step, or, for a
control, that the canary cannot see it. A fault is an engine hook (before_schedule / edit_batch /
during_forward, in an engine with a canary) that records `damage_step`; the first detection is
expected `expect.delay` later.
"""
from __future__ import annotations

import itertools
import os
from dataclasses import dataclass, field, replace
from typing import Callable, Optional

import torch

from ..engine.config import ENV_VARS, FLAG_REAL_KV_DATA
from ..engine.manager import CanaryManager
from ..engine.request_inputs import namespace_inputs, vllm_request_namespace
from ..engine.violations import Violation, sglang_reason_name
from ..trees.schemas import example_schema, generate_tree
from .sim import Engine, SimConfig


def owner_epoch_tree(cache_dir=None):
    """The tree of the shipped example schema owner_epoch.yaml (generated once into the cache)."""
    return generate_tree(example_schema("owner_epoch"), cache_dir)


def example_tree(name: str, cache_dir=None):
    """The tree of a shipped example schema (None for "default": the manager's default tree)."""
    return None if name == "default" else generate_tree(example_schema(name), cache_dir)


# What the simulation's engine integration supplies to request_input fields: the namespace of each
# request from its cache salt and LoRA adapter (the sim's requests carry vLLM's attribute names).
SIM_REQUEST_INPUTS = namespace_inputs(vllm_request_namespace)


# -- faults -----------------------------------------------------------------------------------
class Fault:
    """Base hook: `start` is the first step the fault may fire; `damage_step` is when it did."""

    def __init__(self, start: int):
        self.start = start
        self.damage_step: Optional[int] = None
        self.detail = ""

    def armed(self, engine) -> bool:
        return self.damage_step is None and engine.step_no >= self.start

    def hit(self, engine, detail: str) -> None:
        self.damage_step = engine.step_no
        self.detail = detail


def _decoding(engine):
    """Running requests past their prefill with a few outputs left, oldest first."""
    return [r for r in engine.running if r.kv_len >= len(r.prompt) and r.max_new - r.num_out >= 3]


def _written_pages(engine, req, shared: Optional[bool]):
    """Pages of `req` whose every slot was written before this step (shared: radix-matched ones)."""
    ps = engine.cfg.page_size
    full = req.kv_len // ps
    return [p for i, p in enumerate(req.pages[:full]) if shared is None or (i < req.matched // ps) == shared]


class PageHandedOutTwice(Fault):
    """A page a running request still reads goes back on the free list; the damage is when it is
    handed out again. radix=True: the radix cache evicts a prefix node the request has locked
    (lock-ref bug); radix=False: a stale handle frees one of the request's own pages a second time."""

    def __init__(self, start: int, radix: bool):
        super().__init__(start)
        self.radix = radix
        self.victim = None

    def before_schedule(self, engine) -> None:
        if not self.armed(engine) or self.victim is not None:
            return
        for req in _decoding(engine):
            pages = _written_pages(engine, req, shared=self.radix)
            if pages:
                self.victim, self.page = req, pages[0]
                if self.radix:
                    node = next(n for n in req.nodes if n.page == self.page)
                    del node.parent.children[node.key]   # dropped from the tree, its references kept
                engine.alloc.put_free(self.page)
                engine.alloc.on_alloc.append(lambda page: self._on_alloc(engine, page))
                return

    def _on_alloc(self, engine, page: int) -> None:
        if page == self.page and self.damage_step is None:
            self.hit(engine, f"page {page} (slots {page * engine.cfg.page_size}..) handed out while "
                             f"request {self.victim.rid} still reads it")


class OffByOnePositionAfterSpec(Fault):
    """After a speculative step that rejected drafts, the next step's positions are off by one."""

    def edit_batch(self, engine, batch) -> None:
        if not self.armed(engine):
            return
        for row, req in enumerate(batch.requests):
            if req is not None and row in batch.drafts and req.spec_rejected > 0:
                lo = engine._flat_index(batch, row)
                hi = lo + int(batch.extend_seq_lens[row])
                batch.positions[lo:hi] += 1
                return self.hit(engine, f"request {req.rid}: positions {req.kv_len}.. written as {req.kv_len + 1}..")


class WrongTokenAtChunkBoundary(Fault):
    """Chunked prefill slices one token late: a chunk's first token repeats the previous chunk's last."""

    def edit_batch(self, engine, batch) -> None:
        if not self.armed(engine):
            return
        for row, req in enumerate(batch.requests):
            pre = int(batch.prefix_lens[row]) if req is not None else 0
            if req is not None and 0 < pre < len(req.prompt) and req.max_new >= 2 \
                    and req.tokens[pre - 1] != req.tokens[pre]:
                i = engine._flat_index(batch, row)
                batch.input_ids[i] = req.tokens[pre - 1]
                return self.hit(engine, f"request {req.rid} position {pre}: token {req.tokens[pre - 1]} "
                                        f"instead of {req.tokens[pre]}")


class StaleSwaTranslation(Fault):
    """A new token's full->SWA entry still points at an SWA slot another request owns now."""

    def edit_batch(self, engine, batch) -> None:
        if not self.armed(engine):
            return
        rows = [(row, r) for row, r in enumerate(batch.requests) if r is not None and row in batch.drafts]
        if len(rows) < 2:
            return
        (row_a, a), (_, b) = rows[0], rows[1]
        # Not b's newest slot: that one seeds b's own write this step, which would race on a GPU.
        stale = engine.swa_pool.lookup(engine.slot_of(b, b.kv_len - 2))
        i = engine._flat_index(batch, row_a)
        engine.swa_pool.set_translation(int(batch.out_cache_loc[i]), stale)
        batch.swa_out_cache_loc[i] = stale
        self.hit(engine, f"request {a.rid} position {a.kv_len} -> SWA slot {stale} of request {b.rid}")


class LateWriteIntoFreedPage(Fault):
    """A delayed write of a finished request lands in its former page after the page was reused:
    "bytes" (K/V), "records" (K/V and canary records), "bytes_past_16" (K bytes PARTIAL cannot see)."""

    def __init__(self, start: int, what: str):
        super().__init__(start)
        self.what = what
        self.saved: dict[int, tuple] = {}   # freed page -> (its slots, K/V bytes, canary records)
        self._hooked = False

    def before_schedule(self, engine) -> None:
        if not self._hooked:
            self._hooked = True
            engine.alloc.on_free.append(lambda page: self._save(engine, page))

    def _save(self, engine, page: int) -> None:
        slots = torch.tensor(list(engine.alloc.slots(page)), dtype=torch.int64, device=engine.device)
        self.saved[page] = (slots, engine._copy_bytes(slots), engine.canary.export_records(slots))

    def during_forward(self, engine, batch) -> None:
        if not self.armed(engine):
            return
        for req in _decoding(engine):
            for page in _written_pages(engine, req, shared=None):
                if page in self.saved:
                    return self._land(engine, req, page)

    def _land(self, engine, req, page) -> None:
        slots, data, records = self.saved[page]
        if self.what == "bytes_past_16":
            # The damage starts right after what PARTIAL mode reads and spans one aligned load.
            L = engine.canary.L
            lo = L.REAL_KV_PARTIAL_READ_BYTES
            hi = lo + L.REAL_KV_LOAD_ALIGN_BYTES
            engine.full.slot_view(engine.full.k[0])[slots[0], lo:hi] = data["full"][0][0][0, lo:hi]  # K of layer 0
            where = f"K bytes {lo}..{hi - 1} of slot {int(slots[0])}"
        else:
            engine._paste_bytes(slots, data)
            if self.what == "records":
                engine.canary.import_records(slots, records, len(slots))
            where = f"page {page} ({'K/V bytes and records' if self.what == 'records' else 'K/V bytes'})"
        self.hit(engine, f"stale write into {where}, now read by request {req.rid}")


class ColdPageBitFlip(Fault):
    """One bit of a cached page nobody is reading flips (silent memory damage); only a sweep sees it.
    The byte is the last one PARTIAL mode still reads: every fingerprint mode but NONE covers it."""
    FLIP_MASK = 0x10  # which bit of that byte flips

    def during_forward(self, engine, batch) -> None:
        # Damage in a step that ends with the canary's sweep, so the expected detection step is exact.
        every = engine.canary.sweep_interval
        if not self.armed(engine) or not every or engine.step_no % every != every - 1:
            return
        for node in engine.radix.nodes():
            if node.lock == 0 and engine.alloc.refcount[node.page] == 1:
                slot = node.page * engine.cfg.page_size
                byte = engine.canary.L.REAL_KV_PARTIAL_READ_BYTES - 1
                engine.full.slot_view(engine.full.k[0])[slot, byte] ^= self.FLIP_MASK
                return self.hit(engine, f"bit flip in K byte {byte} of cached slot {slot}")


class PaddingWriteWraps(Fault):
    """A CUDA-graph padding token is stored at slot -1 instead of the dummy slot 0: it lands in the
    pool's last slot. The canary write skips negative slots, so only the bytes change."""

    def edit_batch(self, engine, batch) -> None:
        if not self.armed(engine) or batch.num_padding == 0:
            return
        last = engine.cfg.num_slots - 1
        if not any(last in [engine.slot_of(r, p) for p in range(r.kv_len)] for r in _decoding(engine)):
            return
        n_real = int(batch.extend_seq_lens[:batch.bs - batch.num_padding].sum())
        batch.out_cache_loc[n_real:] = -1
        self.hit(engine, f"{batch.num_padding} padding token(s) stored at slot -1 = slot {last}")


class OutOfRangeSlot(Fault):
    """The allocator returns a slot index one past the pool for a decode token."""

    def edit_batch(self, engine, batch) -> None:
        if not self.armed(engine):
            return
        for row, req in enumerate(batch.requests):
            if req is not None and row in batch.drafts:
                bad = engine.cfg.num_slots
                batch.out_cache_loc[engine._flat_index(batch, row)] = bad
                engine.req_to_token[req.row, req.kv_len] = bad
                return self.hit(engine, f"request {req.rid} position {req.kv_len} -> slot {bad} "
                                        f"(pool has {engine.cfg.num_slots})")


class StaleTransfer(Fault):
    """Host offload + restore hands a request (part of) another request's K/V and canary records.

    shared_prompt=True: only the shared-prompt prefix (same tokens) comes from the other copy: stale
    but self-consistent, invisible to the default record; only an owner field (owner_epoch.yaml's
    request_id) shows it. shared_prompt=False: the whole context, with other tokens.
    """

    def __init__(self, start: int, shared_prompt: bool):
        super().__init__(start)
        self.shared_prompt = shared_prompt
        self.transfer: Optional[tuple] = None  # (victim rid, source rid, tokens transferred)

    def _pair(self, engine):
        """(victim, source, tokens transferred), or None when no running pair fits."""
        pairs = list(itertools.combinations(sorted(_decoding(engine), key=lambda r: (r.kv_len, r.rid)), 2))
        if self.shared_prompt:
            # commonprefix compares any sequences element by element, token lists included.
            k, r1, r2 = max(((len(os.path.commonprefix([a.tokens[:a.kv_len], b.tokens[:b.kv_len]])), a, b)
                             for a, b in pairs), key=lambda t: t[0], default=(0, None, None))
            return (r1, r2, k) if k >= 2 else None
        return next(((a, b, a.kv_len) for a, b in pairs if a.tokens[:a.kv_len] != b.tokens[:a.kv_len]), None)

    def before_schedule(self, engine) -> None:
        pair = self._pair(engine) if self.armed(engine) else None
        if pair is None:
            return
        r1, r2, k = pair
        self.transfer = (r1.rid, r2.rid, k)
        engine.retract(r1)
        engine.retract(r2)
        engine.restore(r1, snapshot_of=r2.rid, upto=k)  # the bug: r2's host copy restored as r1's
        engine.restore(r2)
        what = "same tokens" if self.shared_prompt else "other tokens"
        self.hit(engine, f"request {r1.rid} restored positions 0..{k - 1} of {r1.kv_len} from request "
                         f"{r2.rid}'s host copy ({what})")


class PrefixCacheKeyDrop(Fault):
    """The prefix cache's key drops the request's namespace (cache salt, LoRA adapter): a keying bug, or
    a KV connector that loads blocks by token hash alone. A request then reuses another tenant's pages
    of the same tokens: tokens, positions, chain and K/V bytes all match, so only a namespace field
    (isolation.yaml) shows it. The damage step is the first admission of a request whose prompt prefix
    another namespace has cached: with drop=False (correct keying) it takes none of those pages; with
    across=False (controls) the hit is any prefix reuse within the request's own namespace."""

    def __init__(self, start: int, drop: bool = True, across: bool = True):
        super().__init__(start)
        self.drop, self.across = drop, across
        self.reused: Optional[tuple] = None  # (the request, the foreign pages it took) at the damage step

    def before_schedule(self, engine) -> None:
        if engine.step_no >= self.start:
            engine.radix.keyed = not self.drop

    def edit_batch(self, engine, batch) -> None:
        if not self.armed(engine):
            return
        for row, req in enumerate(batch.requests):
            if req is None or req.kv_len != req.matched or int(batch.prefix_lens[row]) != req.matched:
                continue  # only a request's first batch after admission
            if self.across:
                foreign = [n for n in req.nodes if n.namespace != req.namespace]
                others = [ns for ns in engine.radix.roots if ns != req.namespace and
                          engine.radix.peek(req.tokens[:len(req.tokens) - 1], ns)]
                if foreign:
                    self.reused = (req, [n.page for n in foreign])
                    return self.hit(engine, f"request {req.rid} ({_tenant(req)}) reuses {len(foreign)} page(s) that "
                                            f"{_tenant(foreign[0])} cached, for the same tokens")
                if others and not self.drop:
                    return self.hit(engine, f"request {req.rid} ({_tenant(req)}) shares a prompt prefix with pages "
                                            f"another tenant cached; correct keying gives it none of them")
            elif req.nodes:
                return self.hit(engine, f"request {req.rid} ({_tenant(req)}) reuses {len(req.nodes)} page(s) its "
                                        f"own tenant cached")


def _tenant(obj) -> str:
    """A request's or a radix node's namespace, as the demo prints it."""
    ns = obj.namespace
    if ns is None:
        return "no tenant"
    adapter, salt = ns
    return f"cache_salt {salt!r}" if adapter is None else f"adapter {adapter.lora_name!r}"


# -- scenarios --------------------------------------------------------------------------------
# The checks an expected fail reason needs: {reason: (the check, its CanaryManager option, the values that
# turn it on)}; and how the demo's user sets that option: (the flag or variable as typed, a value's spelling).
CHECKS = {"VERIFY_REAL_KV_HASH_MISMATCH": ("the real-KV fingerprint", "real_kv_hash_mode", ("PARTIAL", "ALL")),
          "VERIFY_TOKEN_MISMATCH": ("the expected-token check", "check_verify_expected_token", (True,))}
TYPED = {"real_kv_hash_mode": (FLAG_REAL_KV_DATA + " ", str.lower),
         "check_verify_expected_token": (ENV_VARS["enable_verify_token_assert"] + "=", lambda on: "1" if on else "0")}


@dataclass(frozen=True)
class Expect:
    launch: Optional[tuple[str, str, str]]  # (phase, half, group) of the launch that must see it; None: a control
    reason: Optional[str] = None
    delay: int = 0              # first detection step - damage step
    needs: tuple = ()           # the values of the reason's CHECKS option that see this fault (default: all of them)

    def check_off(self, options: dict) -> Optional[str]:
        """Why a manager with `options` (CanaryManager keywords, every CHECKS option among them) cannot
        see this fault: the check it needs is off, named as the demo's user turns it on; None when it is on."""
        if self.reason not in CHECKS:
            return None
        check, option, on = CHECKS[self.reason]
        on, value = self.needs or on, options[option]
        if (value.upper() if isinstance(value, str) else value) in on:
            return None
        typed, spell = TYPED[option]
        return (f"it needs {check} ({typed}{' or '.join(spell(v) for v in on)}), which these canary options "
                f"leave off ({typed}{spell(value)})")

    def tag(self, layout) -> Optional[str]:
        """The schema's name for the expected launch's tag (tags are found by coordinates)."""
        return None if self.launch is None else layout.launch_tag(*self.launch).name

    def describe(self, layout) -> str:
        if self.launch is None:
            return "not detected (control)"
        when = "same step" if self.delay == 0 else f"damage step + {self.delay}"
        return f"{self.tag(layout)} {self.reason} ({when})"


@dataclass(frozen=True)
class Scenario:
    name: str
    title: str
    make_fault: Callable[[], Fault]
    expect: Expect
    sim: SimConfig
    steps: int = 48
    manager: dict = field(default_factory=dict)   # CanaryManager keyword overrides
    tree: str = "default"                         # or an example schema: "owner_epoch", "isolation"


@dataclass
class ScenarioResult:
    scenario: Scenario
    damage_step: Optional[int]
    detail: str
    violations: int
    lost: int
    first: Optional[Violation]
    first_launch_reasons: tuple
    per_step: dict
    groups: list
    ok: bool
    why: str
    settings: dict = field(default_factory=dict)   # the canary settings the scenario ran with
    fault: Optional[Fault] = None                  # the fault object after the run (for inspection)
    expected: str = ""                             # what the scenario expects, in the tree's tag names
    expected_tag: Optional[str] = None             # the tree's name of the expected launch's tag (None: control)

    def describe_settings(self) -> str:
        s = self.settings
        return (f"schema {s['schema']}, expected-token check {'on' if s['check_verify_expected_token'] else 'OFF'}, "
                f"real-KV fingerprint {s['real_kv_hash_mode']}, sweep every {s['sweep_interval']} steps")

    @property
    def detected_by(self) -> str:
        if self.first is None:
            return "not detected"
        return f"{self.first.launch_tag} {'+'.join(sglang_reason_name(r) for r in self.first_launch_reasons)}"


BASE = SimConfig(seed=11, num_pages=40, page_size=4, max_running=4, chunk_size=8, prompt_len=(6, 24),
                 output_len=(6, 20), num_system_prompts=2, system_prompt_len=10, swa_window=8)
SWEEP = 6
PREFIX_STEPS = 30  # the prefix-cache scenarios: the first cross-tenant (or same-tenant) hit comes by step 15


def scenarios() -> list[Scenario]:
    no_share = replace(BASE, radix_cache=False, num_swa_layers=0)
    tenants = replace(BASE, tenants=2)
    one_tenant = replace(BASE, tenants=1)
    supplied = {"request_inputs": SIM_REQUEST_INPUTS}  # both schemas get it; only isolation.yaml has the field
    chunked = replace(BASE, chunk_size=5, prompt_len=(14, 24))
    head, tail, sweep = ("head", "k", "full"), ("tail", "k", "full"), ("sweep", "k", "full")  # Expect.launch
    chain, real_kv = "VERIFY_CHAIN_HASH_MISMATCH", "VERIFY_REAL_KV_HASH_MISMATCH"
    return [
        Scenario("slot_reuse_while_referenced", "radix evicts a locked prefix page; it is reused while still read",
                 lambda: PageHandedOutTwice(8, radix=True), Expect(tail, chain), BASE),
        Scenario("double_free", "a page freed twice is handed to a second request",
                 lambda: PageHandedOutTwice(8, radix=False), Expect(tail, chain), BASE),
        Scenario("off_by_one_after_spec", "positions off by one after a speculative step rejected drafts",
                 lambda: OffByOnePositionAfterSpec(8), Expect(head, "WRITE_POSITION_MISMATCH"),
                 replace(BASE, spec_draft_tokens=2)),
        Scenario("wrong_token_at_chunk_boundary", "chunked prefill feeds the previous chunk's last token again",
                 lambda: WrongTokenAtChunkBoundary(6), Expect(head, "VERIFY_TOKEN_MISMATCH", 1), chunked),
        Scenario("wrong_token_at_chunk_boundary/control", "same bug, expected-token check off",
                 lambda: WrongTokenAtChunkBoundary(6), Expect(None), chunked,
                 manager={"check_verify_expected_token": False}),
        Scenario("stale_swa_translation", "a full->SWA entry points at an SWA slot another request owns",
                 lambda: StaleSwaTranslation(8), Expect(("tail", "k", "swa"), chain), BASE),
        Scenario("late_write/bytes", "a delayed K/V write lands in a freed, reused page",
                 lambda: LateWriteIntoFreedPage(4, "bytes"), Expect(tail, real_kv), no_share, steps=64),
        Scenario("late_write/records", "a delayed K/V + canary write lands in a freed, reused page",
                 lambda: LateWriteIntoFreedPage(4, "records"), Expect(tail, chain), no_share, steps=64),
        Scenario("late_write/bytes_past_16", "a delayed write changes only K bytes 16..31 of a reused slot (ALL mode)",
                 lambda: LateWriteIntoFreedPage(4, "bytes_past_16"), Expect(tail, real_kv, needs=("ALL",)), no_share,
                 steps=64),
        Scenario("late_write/bytes_past_16/control", "same damage, PARTIAL mode reads only the first 16 bytes",
                 lambda: LateWriteIntoFreedPage(4, "bytes_past_16"), Expect(None), no_share, steps=64,
                 manager={"real_kv_hash_mode": "PARTIAL"}),
        Scenario("cold_page_bit_flip", "a bit flips in a cached page nobody reads; the sweep finds it",
                 lambda: ColdPageBitFlip(12), Expect(sweep, real_kv), BASE, steps=60,
                 manager={"sweep_interval": SWEEP}),
        Scenario("padding_write_wraps", "a padding token stored at slot -1 lands in the last slot",
                 lambda: PaddingWriteWraps(4), Expect(tail, real_kv), replace(BASE, max_running=3, num_pages=24),
                 steps=120),
        Scenario("out_of_range_slot", "a decode token gets slot index num_slots",
                 lambda: OutOfRangeSlot(8), Expect(head, "SLOT_OUT_OF_RANGE"), no_share),
        Scenario("stale_transfer/default_schema", "offload/restore takes a request's shared-prompt prefix from another "
                 "request's host copy: tokens, positions, chain and K/V bytes all match (expected-token check on)",
                 lambda: StaleTransfer(10, shared_prompt=True), Expect(None), no_share),
        Scenario("stale_transfer/owner_epoch", "same bug, kv_canary/schemas/owner_epoch.yaml: the owner id differs",
                 lambda: StaleTransfer(10, shared_prompt=True), Expect(head, "VERIFY_OWNER_MISMATCH"), no_share,
                 tree="owner_epoch"),
        Scenario("cross_tenant_prefix/default_schema", "the prefix cache drops the cache salt from its key: a "
                 "tenant reuses another tenant's cached prompt prefix (same tokens, positions, chain, K/V bytes)",
                 lambda: PrefixCacheKeyDrop(0), Expect(None), tenants, steps=PREFIX_STEPS, manager=supplied),
        Scenario("cross_tenant_prefix/isolation", "same bug, kv_canary/schemas/isolation.yaml: the reader's "
                 "namespace differs from the writer's", lambda: PrefixCacheKeyDrop(0),
                 Expect(head, "VERIFY_NAMESPACE_MISMATCH"), tenants, steps=PREFIX_STEPS, manager=supplied,
                 tree="isolation"),
        Scenario("cross_adapter_prefix/isolation", "the prefix cache drops the LoRA adapter from its key: a "
                 "request attends to another adapter's K/V (isolation.yaml)", lambda: PrefixCacheKeyDrop(0),
                 Expect(head, "VERIFY_NAMESPACE_MISMATCH"), replace(tenants, tenant_kind="lora"), steps=PREFIX_STEPS,
                 manager=supplied, tree="isolation"),
        Scenario("cross_tenant_prefix/correct_keying", "control: the key keeps the cache salt, tenants sharing "
                 "a prompt prefix do not share pages (isolation.yaml)", lambda: PrefixCacheKeyDrop(0, drop=False),
                 Expect(None), tenants, steps=PREFIX_STEPS, manager=supplied, tree="isolation"),
        Scenario("same_tenant_prefix/isolation", "control: requests of one tenant share a cached prompt prefix "
                 "(isolation.yaml)", lambda: PrefixCacheKeyDrop(0, across=False), Expect(None), one_tenant,
                 steps=PREFIX_STEPS, manager=supplied, tree="isolation"),
        Scenario("stale_transfer/other_tokens", "offload/restore hands a request another request's context "
                 "with other tokens (the expected-token check sees it)", lambda: StaleTransfer(10, shared_prompt=False),
                 Expect(head, "VERIFY_TOKEN_MISMATCH"), no_share),
    ]


def run_scenario(sc: Scenario, *, backend: Optional[str] = None, device="cpu", tree=None,
                 stop_after_detection: bool = False, metrics_registry=None, violations_jsonl=None,
                 **manager_kwargs) -> ScenarioResult:
    """Run one scenario (mode 'log', its own manager) and judge it against its expectation.
    `stop_after_detection`: end two steps after the first violation (the judgement is the same, the
    totals cover the steps run); controls always run every step. `violations_jsonl`: a text stream
    that gets each violation as a JSON line (label scenario)."""
    if tree is None:
        tree = example_tree(sc.tree)
    kwargs = {"mode": "log", "sweep_interval": SWEEP, **sc.manager, **manager_kwargs}
    manager = CanaryManager(tree=tree, backend=backend, **kwargs)
    listeners = scenario_listeners(manager, sc.name, metrics_registry, violations_jsonl)
    fault = sc.make_fault()
    engine = Engine(sc.sim, canary=manager, hooks=[fault], device=device)
    stop_early = stop_after_detection and sc.expect.launch is not None
    seen_at = None
    for step in range(sc.steps):
        engine.step()
        if stop_early and seen_at is None and manager.violations:
            seen_at = step
        if seen_at is not None and step >= seen_at + 2:
            break
    manager.flush()
    for x in listeners:
        x.close()
    return judge(sc, manager, fault)


def judge(sc, manager: CanaryManager, fault) -> ScenarioResult:
    """A finished scenario run against its expectation (any engine's scenario: `name`, `expect`,
    `tree`; a fault with `damage_step` and `detail`)."""
    vs = manager.violations
    first = vs[0] if vs else None
    launch = [v for v in vs if first is not None and (v.step, v.launch_tag) == (first.step, first.launch_tag)]
    reasons = tuple(sorted({r for v in launch for r in v.reasons}))
    e = sc.expect
    want_tag = e.tag(manager.L)
    if fault.damage_step is None:
        ok, why = False, "the fault never fired (no matching state in this run)"
    elif want_tag is None:
        ok = manager.stats.total == 0
        why = "silent, as documented" if ok else f"{manager.stats.total} unexpected violation(s)"
    elif first is None:
        ok, why = False, "not detected"
    else:
        want_step = fault.damage_step + e.delay
        ok = first.launch_tag == want_tag and e.reason in reasons and first.step == want_step
        why = "as expected" if ok else (f"expected {want_tag} {e.reason} at step {want_step}, got {first.launch_tag} "
                                        f"{'+'.join(reasons)} at step {first.step}")
    settings = {"schema": "kernels.yaml" if sc.tree == "default" else f"kv_canary/schemas/{sc.tree}.yaml",
                "check_verify_expected_token": manager.check_verify_expected_token,
                "real_kv_hash_mode": manager.real_kv_hash_mode.name, "sweep_interval": manager.sweep_interval}
    return ScenarioResult(sc, fault.damage_step, fault.detail, manager.stats.total, manager.stats.lost, first,
                          reasons, dict(manager.stats.by_step), manager.grouped(vs[:200]), ok, why, settings, fault,
                          e.describe(manager.L), want_tag)


def scenario_listeners(manager, scenario: str, registry=None, violations_jsonl=None) -> list:
    """What follows a demo run's manager, labelled with the scenario: its Prometheus metrics in
    `registry` and its violations as JSON lines on `violations_jsonl` (each only when given); added
    before the run, as any engine integration may (the manager attaches when the run starts)."""
    out = []
    if registry is not None:
        from ..engine.metrics import CanaryMetrics
        out.append(CanaryMetrics(manager, registry=registry, labels={"scenario": scenario}))
    if violations_jsonl is not None:
        from ..engine.jsonl import ViolationJsonl
        out.append(ViolationJsonl(manager, violations_jsonl, labels={"scenario": scenario}))
    return out


def run_clean(steps: int = 200, *, backend: Optional[str] = None, device="cpu", progress=None,
              metrics_registry=None, violations_jsonl=None, **manager_kwargs):
    """A fault-free run with prefix sharing, chunked prefill and SWA; returns (engine, manager).
    `manager_kwargs` override the demo's manager settings (mode log, a sweep every SWEEP steps);
    with a `metrics_registry` (prometheus_client), the manager's CanaryMetrics export into it; with
    `violations_jsonl` (a text stream), its violations as JSON lines."""
    kwargs = {"mode": "log", "sweep_interval": SWEEP, **manager_kwargs}
    manager = CanaryManager(backend=backend, **kwargs)
    listeners = scenario_listeners(manager, "clean", metrics_registry, violations_jsonl)
    engine = Engine(BASE, canary=manager, device=device)
    engine.run(steps, progress=progress)
    manager.flush()
    for x in listeners:
        x.close()
    return engine, manager
