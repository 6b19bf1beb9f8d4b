"""Radix-style prefix cache over whole pages: a trie keyed by each page's tokens. A node owns one
page (one cache reference); running requests lock the nodes they matched, and eviction only takes
unlocked leaves, least recently used first.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional


@dataclass(eq=False)
class Node:
    key: tuple
    page: int
    parent: Optional["Node"]
    depth: int                      # pages from the root, this one included
    children: dict = field(default_factory=dict)
    lock: int = 0
    last_use: int = 0


class RadixCache:
    def __init__(self, allocator, page_size: int):
        self.alloc = allocator
        self.page_size = page_size
        self.root = Node((), -1, None, 0)
        self._clock = 0

    def _keys(self, tokens):
        ps = self.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) - len(tokens) % ps, ps)]

    def match(self, tokens) -> list[Node]:
        """Nodes of the longest cached page-aligned prefix of `tokens`."""
        self._clock += 1
        node, path = self.root, []
        for key in self._keys(tokens):
            node = node.children.get(key)
            if node is None:
                break
            node.last_use = self._clock
            path.append(node)
        return path

    def lock(self, path, delta: int) -> None:
        for n in path:
            n.lock += delta

    def insert(self, tokens, pages) -> None:
        """Cache the full pages of (tokens, pages)."""
        self._clock += 1
        node = self.root
        for key, page in zip(self._keys(tokens), pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node, node.depth + 1)
                node.children[key] = child
                self.alloc.ref([page])
            if child.page != page:
                break  # same tokens cached on another page; later pages would hang off the wrong chain
            child.last_use = self._clock
            node = child

    def nodes(self):
        stack, out = list(self.root.children.values()), []
        while stack:
            n = stack.pop()
            out.append(n)
            stack.extend(n.children.values())
        return out

    def evict(self, pages_needed: int) -> int:
        """Evict unlocked LRU leaves until `pages_needed` pages were freed (or nothing is left)."""
        freed = 0
        while freed < pages_needed:
            leaves = [n for n in self.nodes() if not n.children and n.lock == 0]
            if not leaves:
                break
            victim = min(leaves, key=lambda n: n.last_use)
            del victim.parent.children[victim.key]
            freed += len(self.alloc.unref([victim.page]))
        return freed
