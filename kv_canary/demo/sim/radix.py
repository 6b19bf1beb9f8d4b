"""Radix-style prefix cache over whole pages: a trie keyed by each page's tokens. A node owns one
page (one cache reference); running requests lock the nodes they matched, and eviction only takes
unlocked leaves, least recently used first.

Like vLLM's block hashes (LoRA adapter, cache salt) and SGLang's `extra_key`, the cache is keyed on
the request's namespace too: one trie per namespace, so tenants and adapters never share a prefix.
`keyed = False` is the keying bug kv_canary/schemas/isolation.yaml catches: every namespace then
shares one trie.
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
    namespace: object = None        # the namespace of the request that cached the page
    children: dict = field(default_factory=dict)
    lock: int = 0
    last_use: int = 0


class RadixCache:
    def __init__(self, allocator, page_size: int):
        self.alloc = allocator
        self.page_size = page_size
        self.roots: dict = {}           # namespace -> the root of its trie
        self.keyed = True               # False: the namespace is dropped from the key (the bug)
        self._clock = 0

    def root(self, namespace) -> Node:
        """The trie a request of `namespace` matches and inserts into."""
        key = namespace if self.keyed else None
        if key not in self.roots:
            self.roots[key] = Node((), -1, None, 0, namespace=key)
        return self.roots[key]

    def _keys(self, tokens):
        ps = self.page_size
        return [tuple(tokens[i:i + ps]) for i in range(0, len(tokens) - len(tokens) % ps, ps)]

    def match(self, tokens, namespace=None) -> list[Node]:
        """Nodes of the longest cached page-aligned prefix of `tokens` (in the namespace's trie)."""
        self._clock += 1
        node, path = self.root(namespace), []
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

    def peek(self, tokens, namespace) -> int:
        """Pages of `tokens` cached in `namespace`'s own trie (nothing touched)."""
        node, n = self.roots.get(namespace), 0
        for key in self._keys(tokens) if node is not None else ():
            node = node.children.get(key)
            if node is None:
                break
            n += 1
        return n

    def insert(self, tokens, pages, namespace=None) -> None:
        """Cache the full pages of (tokens, pages), written by a request of `namespace`."""
        self._clock += 1
        node = self.root(namespace)
        for key, page in zip(self._keys(tokens), pages):
            child = node.children.get(key)
            if child is None:
                child = Node(key, page, node, node.depth + 1, namespace=namespace)
                node.children[key] = child
                self.alloc.ref([page])
            if child.page != page:
                break  # same tokens cached on another page; later pages would hang off the wrong chain
            child.last_use = self._clock
            node = child

    def nodes(self):
        stack, out = [n for root in self.roots.values() for n in root.children.values()], []
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
