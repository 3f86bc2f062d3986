"""A radix tree of token ids at page granularity over the KV page pool (SGLang's RadixAttention).

Each node below the root stands for one full page of `page_size` tokens: its key is those tokens,
its page the KV page that holds them, its parent the page before. A request whose prompt starts
with a cached path reuses those pages instead of prefilling them.

Ownership is by the allocator's reference counts: the cache holds one reference on every page in
the tree; a request that reuses a path takes its own (`PageAllocator.share`) and drops it when it
ends, like any page it allocated. `lock` / `unlock` count the running requests that read a node
and its ancestors: a locked node is never evicted. `evict` frees unlocked leaves, least recently
used first, until enough pages are free (the scheduler asks before it retracts anyone).

Host bookkeeping only (page indices, never device arrays), so it works whatever the sharding.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from jspec.cache.allocator import PageAllocator


class _Node:
    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access")

    def __init__(self, key: tuple, page: int | None, parent: _Node | None):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple, _Node] = {}
        self.lock_ref = 0
        self.last_access = 0


@dataclasses.dataclass
class PrefixMatch:
    """pages: the cached pages of the longest matched prefix, in order; num_tokens: the tokens
    they hold (len(pages) * page_size); node: the deepest matched node (lock it while in use)."""

    pages: list[int]
    num_tokens: int
    node: _Node

    def truncated(self, num_pages: int) -> PrefixMatch:
        """The same match cut to its first num_pages pages."""
        node = self.node
        for _ in range(len(self.pages) - num_pages):
            node = node.parent
        return PrefixMatch(self.pages[:num_pages], self.num_tokens * num_pages // max(len(self.pages), 1), node)


class RadixCache:
    def __init__(self, pages: PageAllocator):
        self.pages = pages
        self.page_size = pages.page_size
        self.root = _Node((), None, None)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_cached_pages = 0
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of which found cached

    # ----------------------------------------------------------------------------- lookup
    def _keys(self, token_ids, limit: int):
        ps = self.page_size
        for i in range(limit // ps):
            yield tuple(token_ids[i * ps:(i + 1) * ps])

    def match_prefix(self, token_ids, *, max_tokens: int | None = None) -> PrefixMatch:
        """The longest cached page-aligned prefix of token_ids, at most max_tokens long (a prompt
        must keep at least its last token to compute: pass len - 1)."""
        limit = len(token_ids) if max_tokens is None else min(max_tokens, len(token_ids))
        node, pages, now = self.root, [], next(self._clock)
        for key in self._keys(token_ids, limit):
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            node = child
            pages.append(child.page)
        return PrefixMatch(pages, len(pages) * self.page_size, node)

    def count(self, prompt_tokens: int, cached_tokens: int) -> None:
        """An admitted prompt and how much of it the cache served (the hit rate's terms)."""
        self.query_tokens += prompt_tokens
        self.hit_tokens += cached_tokens

    def lock(self, node: _Node) -> None:
        while node is not None:
            node.lock_ref += 1
            node = node.parent

    def unlock(self, node: _Node) -> None:
        while node is not None:
            if node.lock_ref <= 0:
                raise ValueError("unlock of a node that is not locked")
            node.lock_ref -= 1
            node = node.parent

    # ----------------------------------------------------------------------------- insert
    def insert(self, token_ids, pages: list[int]) -> int:
        """Cache the full pages of a computed sequence: token_ids[: k * page_size] held by
        pages[:k]. A page whose tokens are cached already keeps the cached copy (the caller's page
        stays the caller's to free). Returns the pages newly added to the tree."""
        node, added, now = self.root, 0, next(self._clock)
        for i, key in enumerate(self._keys(token_ids, min(len(token_ids), len(pages) * self.page_size))):
            child = node.children.get(key)
            if child is None:
                child = _Node(key, pages[i], node)
                node.children[key] = child
                self.pages.share([pages[i]])  # the cache's own reference
                self.num_cached_pages += 1
                added += 1
            child.last_access = now
            node = child
        return added

    # ----------------------------------------------------------------------------- eviction
    def _evictable_leaves(self):
        stack, out = [self.root], []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            if n is not self.root and not n.children and n.lock_ref == 0:
                out.append(n)
        return out

    @property
    def num_evictable_pages(self) -> int:
        """Pages in the tree that no running request reads (freeable by eviction)."""
        stack, count = [self.root], 0
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            count += n is not self.root and n.lock_ref == 0
        return count

    def evict(self, num_pages: int) -> int:
        """Remove unlocked leaves, least recently used first, until num_pages pages went back to
        the free list or nothing is left to evict; returns the pages freed."""
        heap = [(n.last_access, id(n), n) for n in self._evictable_leaves()]
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_pages:
            _, _, node = heapq.heappop(heap)
            parent = node.parent
            del parent.children[node.key]
            before = self.pages.num_free
            self.pages.free([node.page])
            freed += self.pages.num_free - before  # 0 while a request still holds the page
            self.num_cached_pages -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    def flush(self) -> bool:
        """Drop every cached page (SGLang's flush_cache); refused (False) while requests hold nodes."""
        if any(n.lock_ref for n in self.root.children.values()):
            return False
        self.evict(self.num_cached_pages)
        self.query_tokens = self.hit_tokens = 0
        return True

    @property
    def hit_rate(self) -> float:
        return self.hit_tokens / self.query_tokens if self.query_tokens else 0.0
