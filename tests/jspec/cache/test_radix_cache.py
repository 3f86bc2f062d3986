"""The prefix cache's tree (`jspec.cache.radix_cache`) over a real page allocator: page-aligned
matches capped where the caller asks, shared pages counted by the allocator, duplicates kept once,
LRU eviction of unlocked leaves only, flush refused while a request holds a path, and every page
back on the free list at the end."""

from __future__ import annotations

import pytest

from jspec.cache.allocator import PageAllocator
from jspec.cache.radix_cache import RadixCache

PS = 4


def _request(pages: PageAllocator, tokens: list[int]) -> list[int]:
    """Pages a request computed its tokens into (as the scheduler allocates them)."""
    return pages.alloc(pages.pages_for(len(tokens)))


def test_match_is_page_aligned_capped_and_shares_pages():
    pages = PageAllocator(32, PS)
    cache = RadixCache(pages)
    a = list(range(10))  # two full pages and a partial one
    a_pages = _request(pages, a)
    assert cache.insert(a, a_pages) == 2  # only full pages are cached
    pages.free(a_pages)  # the request ends: its partial page is free, the cached two are not
    assert pages.num_free == 31 - 2 and cache.num_cached_pages == 2
    m = cache.match_prefix(a + [99])
    assert m.pages == a_pages[:2] and m.num_tokens == 8
    assert cache.match_prefix(a[:8], max_tokens=7).num_tokens == 4  # keep the last token to compute
    assert cache.match_prefix([0, 1, 2, 9, 9]).num_tokens == 0  # first page differs
    assert cache.match_prefix(a[:6]).num_tokens == 4
    cache.count(11, 8)
    cache.count(5, 0)
    assert cache.hit_rate == pytest.approx(8 / 16)


def test_bigram_keys_cover_the_token_after_each_page():
    """With bigram keys a page matches only where the token after it matches too, so a page is
    cached only once the token after it is known; without them the page's own tokens decide. Large
    token ids (a 151k vocabulary) key as any other; `key_tokens` reads a key's page back."""
    for bigram in (False, True):
        pages = PageAllocator(32, PS)
        cache = RadixCache(pages, bigram=bigram)
        a = [150_000 + i for i in range(8)] + [7]  # two full pages and the token after them
        a_pages = _request(pages, a)
        assert cache.insert(a, a_pages) == 2
        assert cache.insert(a[:8], a_pages) == 0  # cached already
        fresh = PageAllocator(32, PS)
        assert RadixCache(fresh, bigram=bigram).insert(a[:8], _request(fresh, a[:8])) == (1 if bigram else 2)
        assert cache.match_prefix(a[:8] + [5, 0]).num_tokens == (4 if bigram else 8)  # the ninth token differs
        assert cache.match_prefix(a + [0]).num_tokens == 8
        assert sorted(cache.key_tokens(n.key) for n in cache.root.children.values()) == [a[:4]]


def test_duplicates_keep_the_cached_copy_and_branches_share_their_prefix():
    pages = PageAllocator(32, PS)
    cache = RadixCache(pages)
    a, b = [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9]
    pa, pb = _request(pages, a), _request(pages, b)
    assert cache.insert(a, pa) == 2
    assert cache.insert(b, pb) == 1  # the first page is cached already (pa[0] kept)
    pages.free(pa)
    pages.free(pb)
    assert cache.num_cached_pages == 3 and pages.num_free == 31 - 3  # pb[0] went back to the pool
    assert cache.match_prefix(b).pages == [pa[0], pb[1]]


def test_eviction_is_lru_over_unlocked_leaves():
    pages = PageAllocator(16, PS)
    cache = RadixCache(pages)
    seqs = [[s] * 8 for s in range(3)]  # three two-page sequences, no shared prefix
    for s in seqs:
        p = _request(pages, s)
        cache.insert(s, p)
        pages.free(p)
    assert pages.num_free == 15 - 6
    held = cache.match_prefix(seqs[0])
    cache.lock(held.node)  # a running request reads sequence 0
    cache.match_prefix(seqs[2])  # sequence 2 used more recently than 1
    assert cache.num_evictable_pages == 4
    assert cache.evict(1) == 1  # the least recently used leaf: sequence 1's second page
    assert cache.match_prefix(seqs[1]).num_tokens == 4
    assert cache.evict(100) == 3  # everything unlocked; sequence 0 stays
    assert cache.match_prefix(seqs[0]).num_tokens == 8 and cache.num_cached_pages == 2
    assert not cache.flush()  # refused while a request holds a path
    cache.unlock(held.node)
    assert cache.flush() and cache.num_cached_pages == 0
    pages.check_all_free()
    with pytest.raises(ValueError, match="not locked"):
        cache.unlock(held.node)


def test_a_page_a_request_still_holds_is_not_counted_as_freed():
    pages = PageAllocator(8, PS)
    cache = RadixCache(pages)
    s = list(range(8))
    p = _request(pages, s)
    cache.insert(s, p)
    pages.share(p[:1])  # another request reuses the first page (without locking: a misuse)
    pages.free(p)
    assert cache.evict(2) == 1  # the second page is free again; the first is still referenced
    pages.free(p[:1])
    pages.check_all_free()


def test_a_snapshot_taken_this_step_is_pending_until_the_next():
    """Hybrid: a snapshot attached while a step is planned is not loadable in that step; a match
    reports it as pending (the scheduler defers a request it would serve), then loads it."""
    pages = PageAllocator(32, PS)
    cache = RadixCache(pages, state_slots=[7])
    a = list(range(13))
    a_pages = _request(pages, a)
    cache.insert(a, a_pages)
    node = cache.path_end(a, 8)
    assert cache.attach_state(node, cache.alloc_state())
    m = cache.match_prefix(a)
    assert (m.num_tokens, m.branch, m.pending) == (0, 12, 8)
    assert cache.truncate(m, 3).pending == 8
    cache.begin_step()
    m = cache.match_prefix(a)
    assert (m.num_tokens, m.state, m.branch, m.pending) == (8, 7, 12, 0)


def _stateful(rows: list[int]):
    pages = PageAllocator(64, PS)
    cache = RadixCache(pages, state_slots=rows)
    a = list(range(25))
    cache.insert(a, _request(pages, a))
    return cache, a


def test_an_inner_snapshot_on_a_locked_path_can_go_but_not_one_this_step_loads():
    """Hybrid: a running request locks its path, which keeps the path's chunk-end snapshots; an
    unproven inner one there may still go (the request read at most the one it loaded, in the step
    that admitted it). The snapshot a step loads keeps its row through that step (a save in the
    same step must not overwrite it)."""
    cache, a = _stateful([4, 5])
    end, inner = cache.path_end(a, 24), cache.path_end(a, 8)
    cache.attach_state(end, cache.alloc_state())
    cache.attach_state(inner, cache.alloc_state(inner=True), inner=True)
    cache.lock(end)  # a itself still runs
    cache.begin_step()
    m = cache.match_prefix(a, max_tokens=12)  # a prompt that shares 8 tokens with a: loads the inner one
    cache.lock(m.node)
    cache.loading.add(m.node)  # (PrefixReuse.reuse)
    assert m.state == inner.state and cache.alloc_state() is None  # end is locked, inner loads now
    cache.begin_step()
    inner.unproven = True  # (as if never loaded) the next step may take its row, locked or not
    row = inner.state
    assert cache.alloc_state() == row and inner.state is None and end.state is not None
    cache.unlock(m.node)
    cache.unlock(end)


def test_inner_snapshots_go_first_and_never_push_out_others():
    """Snapshots taken inside a prompt chunk are dropped before any other (least recently used
    first); an inner one takes no row from another kind; one that a match loaded counts as proven."""
    cache, a = _stateful([1, 2, 3])
    inner8, inner16, end = (cache.path_end(a, n) for n in (8, 16, 24))
    cache.attach_state(end, cache.alloc_state())  # a chunk end
    cache.attach_state(inner8, cache.alloc_state(inner=True), inner=True)
    cache.attach_state(inner16, cache.alloc_state(inner=True), inner=True)
    cache.begin_step()
    end.last_access, inner8.last_access, inner16.last_access = 0, 1, 2  # plain LRU would drop `end`
    row8 = inner8.state
    row = cache.alloc_state(inner=True)
    assert row == row8 and inner8.state is None and inner16.state is not None and end.state is not None
    cache.attach_state(inner8, row, inner=True)
    cache.begin_step()
    inner8.unproven = inner16.unproven = False  # both loaded by later prompts (PrefixReuse.reuse)
    assert cache.alloc_state(inner=True) is None  # no unproven snapshot left to replace
    assert {end.state, inner8.state, inner16.state} == {1, 2, 3}
    row = cache.alloc_state()  # any other snapshot takes the least recently used row
    assert row is not None and sum(n.state is None for n in (end, inner8, inner16)) == 1
