"""Paged KV storage, the page allocator, and the SWA pool with its full->SWA translation table."""
from __future__ import annotations

import random
from collections import deque

import torch

FULL = "full"
SWA = "swa"


class KvStorage:
    """K and V byte tensors per layer: uint8 [num_rows, rows_slots * bytes_per_token], slot s at
    row s // row_slots, byte (s % row_slots) * bytes_per_token (how a RealKvSource reads it)."""

    def __init__(self, num_layers: int, num_slots: int, row_slots: int, bytes_per_token: int, device):
        if num_slots % row_slots:
            raise ValueError(f"KvStorage num_slots must be a multiple of row_slots={row_slots}, got {num_slots}")
        self.num_slots = num_slots
        self.row_slots = row_slots
        self.bytes_per_token = bytes_per_token
        shape = (num_slots // row_slots, row_slots * bytes_per_token)
        self.k = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=torch.uint8, device=device) for _ in range(num_layers)]

    def halves(self):
        return (self.k, self.v)

    def slot_view(self, tensor: torch.Tensor) -> torch.Tensor:
        """[num_slots, bytes_per_token] view of one layer's tensor."""
        return tensor.view(self.num_slots, self.bytes_per_token)


class PageAllocator:
    """Refcounted pages of `page_size` slots; page 0 is reserved (slot 0 is the padding slot). The
    most recently freed page is reused first (use-after-free bugs bite quickly); the initial order
    is seeded. Every allocation bumps the allocation epoch of the page's slots."""

    def __init__(self, num_pages: int, page_size: int, seed: int, device="cpu"):
        if num_pages < 2:
            raise ValueError(f"PageAllocator num_pages must be >= 2 (page 0 is reserved), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        pages = list(range(1, num_pages))
        random.Random(seed).shuffle(pages)
        self.free = deque(pages)
        self.refcount = [0] * num_pages
        self.epoch = torch.zeros(num_pages * page_size, dtype=torch.int64, device=device)
        self.on_alloc = []  # callbacks(page) run on every handed-out page (fault tracking)
        self.on_free = []   # callbacks(page) run on every page put on the free list

    @property
    def num_free(self) -> int:
        return len(self.free)

    def alloc(self, n: int) -> list[int]:
        if n > len(self.free):
            raise MemoryError(f"PageAllocator: need {n} pages, {len(self.free)} free")
        pages = [self.free.popleft() for _ in range(n)]
        for p in pages:
            self.refcount[p] += 1
            self.epoch[p * self.page_size:(p + 1) * self.page_size] += 1
            for cb in self.on_alloc:
                cb(p)
        return pages

    def ref(self, pages) -> None:
        for p in pages:
            self.refcount[p] += 1

    def unref(self, pages) -> list[int]:
        """Drop one reference per page; returns the pages that became free."""
        freed = []
        for p in pages:
            if self.refcount[p] <= 0:
                raise RuntimeError(f"PageAllocator: page {p} released more often than referenced")
            self.refcount[p] -= 1
            if self.refcount[p] == 0:
                self.put_free(p)
                freed.append(p)
        return freed

    def put_free(self, page: int) -> None:
        """Put `page` on the free list; called directly, whatever its references, it is a refcount bug."""
        self.free.appendleft(page)
        for cb in self.on_free:
            cb(page)

    def slots(self, page: int) -> range:
        return range(page * self.page_size, (page + 1) * self.page_size)


class SwaPool:
    """SWA slots (one per written full slot, living as long as its page) and the full->SWA table
    (0 = none); handed out in a seeded order, so the translation is never the identity."""

    def __init__(self, num_full_slots: int, seed: int, device):
        ids = list(range(1, num_full_slots))
        random.Random(seed ^ 0x5A5A).shuffle(ids)
        self.free = deque(ids)
        self.num_slots = num_full_slots
        self.full_to_swa = torch.zeros(num_full_slots, dtype=torch.int64, device=device)
        self.epoch = torch.zeros(num_full_slots, dtype=torch.int64, device=device)  # allocation epoch per SWA slot
        self._host = [0] * num_full_slots

    def assign(self, full_slots: list[int]) -> None:
        """SWA slots for newly written full slots (already-mapped slots keep theirs)."""
        for s in full_slots:
            if self._host[s] == 0:
                if not self.free:
                    raise MemoryError("SwaPool: no free SWA slot")
                self._host[s] = self.free.popleft()
                self.full_to_swa[s] = self._host[s]
                self.epoch[self._host[s]] += 1

    def lookup(self, full_slot: int) -> int:
        return self._host[full_slot]

    def release(self, full_slots) -> None:
        for s in full_slots:
            if self._host[s]:
                self.free.appendleft(self._host[s])
                self._host[s] = 0
                self.full_to_swa[s] = 0

    def set_translation(self, full_slot: int, swa_slot: int) -> None:
        """Overwrite one table entry (fault injection: a stale translation)."""
        self._host[full_slot] = swa_slot
        self.full_to_swa[full_slot] = swa_slot
