"""What the scheduler side of the connector tells the worker side each step (plain, picklable data).

vLLM pickles the connector metadata from the engine core's scheduler to the worker with the step's
SchedulerOutput; the worker's batch (attention metadata) carries no request ids, so the scheduler
says, per scheduled request, where its write starts (`write_slot`), which is how the worker tells
its batch rows apart. Everything here is per request or per block, never per token, except the token
ids a request has not shipped yet (its prompt once, then one sampled token per step).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Scheduled:
    """One request of the step."""
    req_id: str
    computed: int                 # tokens in the cache before this step (what the forward reads)
    scheduled: int                # tokens this step writes, at positions computed .. computed+scheduled-1
    write_slot: int               # the slot of position `computed`: block_ids[computed // bs] * bs + computed % bs
    matched: int = -1             # >= 0 on admission (new, or resumed after a preemption): its prefix-cache hit
    sent: int = 0                 # position of new_tokens[0] in the request's token ids
    new_tokens: tuple = ()        # its token ids the worker does not have yet
    new_blocks: tuple = ()        # blocks newly handed to it (their slots get a new allocation epoch)
    inputs: tuple = ()            # on admission: its request_input values, in the schema's field order


@dataclass(frozen=True)
class CachedBlock:
    """A full block a finished request leaves in the prefix cache (what the sweep verifies)."""
    block: int
    first_position: int
    tokens: tuple
    parent: int                   # the block before it in that request (-1: the request's first block)


@dataclass(frozen=True)
class StepMeta:
    """One scheduler step as the worker side needs it."""
    step: int
    released: tuple = ()          # requests finished, aborted or preempted since the previous step
    scheduled: tuple = ()         # Scheduled, one per request of the step
    cached: tuple = ()            # CachedBlock, kept for reuse since the previous step
    same_forward_reads: bool = False   # an admitted request's prefix hit includes a block this step writes
    unguardable: str = ""         # why this step cannot be guarded (the worker turns its canary off)
