"""The scheduler side of the vLLM connector: turns each SchedulerOutput into a StepMeta.

It keeps a reference to every request the scheduler admits (`update_state_after_alloc`), reads
their token ids and the KV cache manager's block lists when it builds a step's metadata (before the
scheduler advances `num_computed_tokens`), and records, when a request finishes, what its full
blocks hold if the prefix cache keeps them. No vLLM import: the objects are vLLM's own, read by duck
typing (kv_canary.integrations.vllm.connector checks the version they come from).
"""
from __future__ import annotations

from ...engine.request_inputs import check_request_values
from .meta import CachedBlock, Scheduled, StepMeta


class SchedulerSide:
    def __init__(self, *, block_size: int, prefix_caching: bool, input_fields: tuple = (), request_inputs=None):
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        # The schema's request_input fields and the user's function of vLLM's Request that fills them
        # (inputs.resolve): asked here, where the Request with its adapter and cache salt lives.
        self.input_fields = tuple(input_fields)
        self.request_inputs = request_inputs
        self.kv_cache_manager = None
        self.requests: dict = {}      # req_id -> vLLM Request (admitted, not finished)
        self.sent: dict = {}          # req_id -> token ids shipped to the worker (the worker holds its row)
        self.blocks_known: dict = {}  # req_id -> blocks already reported (new_blocks is the rest)
        self._released: set = set()
        self._cached: list = []
        self.step = 0

    def admit(self, request) -> None:
        self.requests[request.request_id] = request

    def finished(self, request, block_ids) -> None:
        """`request_finished`: record its cached full blocks; its row is released at the next step."""
        rid = request.request_id
        self.requests.pop(rid, None)
        if rid in self.sent:
            self._released.add(rid)
        if not self.prefix_caching or not block_ids:
            return
        bs = self.block_size
        tokens = request.all_token_ids
        full = min(len(getattr(request, "block_hashes", ())), request.num_computed_tokens // bs, len(block_ids))
        for i in range(full):
            self._cached.append(CachedBlock(int(block_ids[i]), i * bs, tuple(tokens[i * bs:(i + 1) * bs]),
                                            int(block_ids[i - 1]) if i else -1))

    def build(self, out) -> StepMeta:
        """The StepMeta of one SchedulerOutput."""
        released = set(self._released) | {r for r in (out.finished_req_ids or ()) if r in self.sent}
        released |= {r for r in (out.preempted_req_ids or ()) if r in self.sent}
        for rid in released:
            self.sent.pop(rid, None)
            self.blocks_known.pop(rid, None)
        self._released.clear()
        bs = self.block_size
        scheduled, written, hits = [], set(), []
        for rid, n in out.num_scheduled_tokens.items():
            req = self.requests[rid]
            computed = req.num_computed_tokens
            blocks = self.kv_cache_manager.get_block_ids(rid)[0]
            tokens = req.all_token_ids
            matched, inputs = -1, ()
            if rid not in self.sent:             # admission: new, or resumed after a preemption
                matched = computed
                if self.input_fields:
                    inputs = check_request_values(self.request_inputs(req), self.input_fields, req)
                self.sent[rid] = 0
                self.blocks_known[rid] = computed // bs
                if computed:
                    hits.append((rid, blocks[:computed // bs]))
            sent = self.sent[rid]
            new_tokens = tuple(tokens[sent:])
            self.sent[rid] = sent + len(new_tokens)
            known = self.blocks_known[rid]
            new_blocks = tuple(blocks[known:])
            self.blocks_known[rid] = len(blocks)
            first, last = computed // bs, (computed + n - 1) // bs
            written.update((b, rid) for b in blocks[first:last + 1])
            scheduled.append(Scheduled(rid, computed, n, blocks[first] * bs + computed % bs, matched, sent,
                                       new_tokens, new_blocks, inputs))
        writers = {}
        for b, rid in written:
            writers.setdefault(b, set()).add(rid)
        same = any(writers.get(b, {rid}) - {rid} for rid, blocks in hits for b in blocks)
        cached, self._cached = tuple(self._cached), []
        copies = getattr(out, "kv_cache_block_copies", None)
        why = (f"vLLM copies {len(copies)} KV block(s) on the worker this step (copy-on-write of a partial prefix "
               f"hit); their canary records do not travel with them") if copies else ""
        meta = StepMeta(self.step, tuple(sorted(released)), tuple(scheduled), cached, bool(same), why)
        self.step += 1
        return meta
