"""A radix tree of token ids at page granularity over the KV page pool (SGLang's RadixAttention).

Each node below the root stands for one full page of `page_size` tokens: its key is those tokens,
its page the KV page that holds them, its parent the page before. A request whose prompt starts
with a cached path reuses those pages instead of prefilling them.

Ownership is by the allocator's reference counts: the cache holds one reference on every page in
the tree; a request that reuses a path takes its own (`PageAllocator.share`) and drops it when it
ends, like any page it allocated. `lock` / `unlock` count the running requests that read a node
and its ancestors: a locked node is never evicted. `evict` frees unlocked leaves, least recently
used first, until enough pages are free (the scheduler asks before it retracts anyone).

With `bigram` (SGLang's EAGLE keys) position p is keyed by the pair (token p, token p + 1), so a
page's key holds its tokens and the one after them: an EAGLE-family drafter's KV at p is computed
from the target's hidden at p and the token after it, so a page is reusable only where the next
token matches too. A page then needs the token after it to be known before it can be cached, and a
match never covers a prompt's last token either way.

Hybrid targets (`state_slots` given): a Gated-DeltaNet layer's state at a prefix cannot be rebuilt
from KV pages, so a node may also hold a state snapshot (the recurrent state and conv window after
its last token), kept in extra rows of the state pool (`state_slots`: their indices). A match then
stops at the deepest node with a snapshot; `PrefixMatch.branch` says how far the pages alone
matched, so the scheduler can take a snapshot there while it recomputes. Snapshots have their own
LRU: when none is free, the least recently used one of an unlocked node is dropped (its pages stay).
Snapshots taken inside a prompt chunk on the chance that a later prompt branches there (`inner`)
go first, locked path or not (a running request reads no snapshot after the step that loaded it),
until a match loads one; an inner snapshot never takes the row of another kind. So however many a
prompt leaves, they never cost a later prompt the snapshot at a chunk end or branch point.

Host bookkeeping only (page indices, never device arrays), so it works whatever the sharding.
"""

from __future__ import annotations

import dataclasses
import heapq
import itertools

from jspec.cache.allocator import PageAllocator


class _Node:
    __slots__ = ("key", "page", "parent", "children", "lock_ref", "last_access", "state", "depth", "unproven")

    def __init__(self, key: tuple, page: int | None, parent: _Node | None):
        self.key, self.page, self.parent = key, page, parent
        self.children: dict[tuple, _Node] = {}
        self.lock_ref = 0
        self.last_access = 0
        self.state: int | None = None  # a state-pool row holding the GDN state after this node (hybrid)
        self.unproven = False  # its snapshot was taken inside a chunk and no match has loaded it yet
        self.depth = 0 if parent is None else parent.depth + 1  # pages from the root


@dataclasses.dataclass
class PrefixMatch:
    """pages: the cached pages of the longest usable prefix, in order; num_tokens: the tokens
    they hold (len(pages) * page_size); node: the deepest matched node (lock it while in use).
    Hybrid caches: state, the snapshot row of `node` (None at the root); branch, the tokens that
    the pages alone matched (>= num_tokens); pending, the tokens up to the deepest matched node
    whose snapshot the step being planned takes (loadable from the next step on; 0 if none)."""

    pages: list[int]
    num_tokens: int
    node: _Node
    state: int | None = None
    branch: int = 0
    pending: int = 0


class RadixCache:
    def __init__(self, pages: PageAllocator, *, bigram: bool = False, state_slots: list[int] | None = None):
        self.pages = pages
        self.bigram = bigram
        self.stateful = state_slots is not None
        self.free_states = list(state_slots or [])
        self.num_state_slots = len(self.free_states)
        self.stateful_nodes: set[_Node] = set()
        self.fresh: set[_Node] = set()  # snapshots taken by the step being planned: not loadable in it
        self.loading: set[_Node] = set()  # snapshots the step being planned loads: not droppable in it
        self.page_size = pages.page_size
        self.root = _Node((), None, None)
        self.root.lock_ref = 1  # never evicted
        self._clock = itertools.count(1)
        self.num_cached_pages = 0
        self.query_tokens = 0  # prompt tokens looked up
        self.hit_tokens = 0  # of which found cached

    # ----------------------------------------------------------------------------- lookup
    def _keys(self, token_ids, limit: int) -> list[tuple]:
        """The keys of the full pages among the first `limit` positions that have one: each page's
        tokens, with `bigram` and the token after it: those fix its positions' pairs, and a flat
        tuple is much cheaper to build than one of pairs (the scheduler builds a prompt's keys at
        each admission)."""
        ps, extra = self.page_size, 1 if self.bigram else 0
        n = max(min(limit, len(token_ids) - extra), 0) // ps
        return [tuple(token_ids[i * ps:(i + 1) * ps + extra]) for i in range(n)]

    def key_tokens(self, key: tuple) -> list[int]:
        """The tokens of the page that `key` names (without a bigram key's next token)."""
        return list(key[:self.page_size])

    def page_keys(self, token_ids, max_tokens: int) -> list[tuple]:
        """The page keys `match_prefix` walks, for a caller that looks the same prompt up often."""
        return self._keys(token_ids, max_tokens)

    def match_prefix(self, token_ids=None, *, max_tokens: int | None = None, keys=None) -> PrefixMatch:
        """The longest cached page-aligned prefix of token_ids, at most max_tokens long (a prompt
        must keep at least its last token to compute: pass len - 1); or of precomputed `keys`
        (`page_keys`)."""
        if keys is None:
            keys = self._keys(token_ids, len(token_ids) if max_tokens is None else max_tokens)
        node, pages, now = self.root, [], next(self._clock)
        usable = self.root  # hybrid: the deepest node whose snapshot a step may load
        pending = 0  # hybrid: the deepest node whose snapshot the step being planned takes
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            child.last_access = now
            node = child
            pages.append(child.page)
            if self._loadable(child):
                usable = child
            elif child in self.fresh:
                pending = child.depth
        if not self.stateful:
            return PrefixMatch(pages, len(pages) * self.page_size, node)
        return self._cut(pages, usable, branch=len(pages) * self.page_size, pending=pending * self.page_size)

    def _cut(self, pages: list[int], node: _Node, branch: int, pending: int = 0) -> PrefixMatch:
        """The match of `pages` ended at `node`, one of their nodes."""
        return PrefixMatch(pages[:node.depth], node.depth * self.page_size, node, node.state, branch, pending)

    def path_end(self, token_ids, max_tokens: int) -> _Node:
        """The deepest node along token_ids (at most max_tokens), whatever its snapshots."""
        node = self.root
        for key in self._keys(token_ids, max_tokens):
            child = node.children.get(key)
            if child is None:
                break
            node = child
        return node

    def truncate(self, match: PrefixMatch, num_pages: int) -> PrefixMatch:
        """match cut to its first num_pages pages (hybrid: further, to the deepest node left with
        a loadable snapshot)."""
        node = match.node
        while node.depth > num_pages or (self.stateful and node.parent is not None and not self._loadable(node)):
            node = node.parent
        return self._cut(match.pages, node, match.branch, match.pending)

    def _loadable(self, node: _Node) -> bool:
        return node.state is not None and node not in self.fresh

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
    def insert(self, token_ids, pages: list[int], num_computed: int | None = None) -> int:
        """Cache the full pages of a computed sequence: pages[:k] hold the KV of its first
        num_computed positions (default: every token of token_ids, which may run past them: with
        `bigram` the token after the last computed one completes its key). A page whose key is
        cached already keeps the cached copy (the caller's page stays the caller's to free).
        Returns the pages newly added to the tree."""
        node, added, now = self.root, 0, next(self._clock)
        limit = len(pages) * self.page_size
        if num_computed is not None:
            limit = min(limit, num_computed)
        for i, key in enumerate(self._keys(token_ids, limit)):
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
            self._drop_state(node)
            before = self.pages.num_free
            self.pages.free([node.page])
            freed += self.pages.num_free - before  # 0 while a request still holds the page
            self.num_cached_pages -= 1
            if parent is not self.root and not parent.children and parent.lock_ref == 0:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed

    # ----------------------------------------------------------------------------- snapshots (hybrid)
    def begin_step(self) -> None:
        """A new step is being planned: snapshots the previous one takes are loadable from now on
        (steps run in order on the device)."""
        self.fresh.clear()
        self.loading.clear()

    def alloc_state(self, *, inner: bool = False) -> int | None:
        """A free snapshot row; when none is free, the row of the least recently used unproven inner
        snapshot, else (unless the row is for an `inner` snapshot) of the least recently used
        snapshot of an unlocked node; never one that the step being planned writes or loads. None
        when no row can be had."""
        if not self.free_states:
            victims = [n for n in self.stateful_nodes
                       if (n.lock_ref == 0 or n.unproven) and n not in self.fresh and n not in self.loading]
            pool = [n for n in victims if n.unproven] or ([] if inner else victims)
            if not pool:
                return None
            self._drop_state(min(pool, key=lambda n: n.last_access))
        return self.free_states.pop()

    def release_state(self, row: int) -> None:
        """A snapshot row that no node holds goes back to the free rows."""
        self.free_states.append(row)

    def attach_state(self, node: _Node, row: int, *, inner: bool = False) -> bool:
        """Give `node` the snapshot that the step being planned writes into `row` (`inner`: taken
        inside a prompt chunk, unproven until a match loads it); False (row freed) when the node has
        one already or is the root."""
        if node.parent is None or node.state is not None:
            self.release_state(row)
            return False
        node.state = row
        node.unproven = inner
        self.stateful_nodes.add(node)
        self.fresh.add(node)
        return True

    def _drop_state(self, node: _Node) -> None:
        if node.state is not None:
            self.release_state(node.state)
            node.state = None
            node.unproven = False
            self.stateful_nodes.discard(node)
            self.fresh.discard(node)

    @property
    def num_cached_states(self) -> int:
        return len(self.stateful_nodes)

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
