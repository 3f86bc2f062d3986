"""The scheduler's side of the prefix cache (`jspec.cache.radix_cache`): which cached prefix an
admitted request reuses, what its dispatched prompt chunks and its finish put into the tree, the
GDN state snapshots of hybrid targets, and the LPM order of the waiting queue.

- A request reuses the pages of its longest cached page-aligned prefix (hybrid targets: up to the
  deepest snapshot, which its first step copies into its slot) and prefills from there.
- The penalty state is built from the tokens a step feeds: a request with a penalty reuses prompt
  tokens but not the outputs a retracted request feeds again (they are counted as they are fed);
  with a repetition penalty, which counts prompt tokens too, its slot is seeded with the cached
  prompt tokens before its first step (`ScheduledReq.seed_prompt`).
- Pages join the tree as soon as each prompt chunk is dispatched (SGLang caches unfinished requests
  too), so requests admitted while this one still runs share them; steps run in order on the
  device, so a later reader reads them after the chunk wrote them. A finished or retracted request
  puts in every full page below its known length.
- Hybrid targets: a prompt chunk that ends on a page boundary leaves a snapshot of the state there,
  and inside a long chunk one about every track interval (at the first end of the chunked GDN
  kernel's 64-token chunks past each multiple of it that lies on a page boundary), so that a later
  prompt that branches off inside it recomputes at most about an interval; where the pages matched
  further than any snapshot (a branch point, e.g. the end of a shared system prompt), the scheduler
  cuts the request's chunk at that point so that its snapshot is taken.
  Prompts that arrive together share nothing cached yet: a newly admitted one's first chunk ends
  where it shares whole pages with a waiting request (`shared_with`), and a waiting request that a
  snapshot taken in the step being planned would serve waits one step for it (`waits_for_snapshot`)
  instead of recomputing the shared prefix.
"""

from __future__ import annotations

from collections import deque

from jspec.cache.allocator import PageAllocator
from jspec.cache.radix_cache import PrefixMatch, RadixCache
from jspec.runtime.request import Request
from jspec.runtime.step_inputs import GDN_CHUNK


class PrefixReuse:
    def __init__(self, cache: RadixCache, pages: PageAllocator):
        self.cache, self.pages = cache, pages

    def _keys(self, req: Request) -> list[tuple]:
        """The page keys of the prompt prefix `req` may take from the cache, kept with the request
        while it waits (LPM and the shared-prefix scan look waiting prompts up every step)."""
        sp = req.sampling
        # The last prompt token is always computed: its logits give the first output.
        limit = req.prefill_target - 1
        if sp.frequency_penalty or sp.presence_penalty or sp.repetition_penalty != 1.0:
            limit = min(limit, len(req.input_ids))
        if req.input_logprob_next < len(req.input_ids):  # input logprobs it still needs are computed
            limit = min(limit, max(req.input_logprob_next - 1, 0))
        if req.page_keys is None or req.page_keys[0] != (req.prefill_target, limit):
            keys = self.cache.page_keys(req.all_ids[:req.prefill_target], limit)
            req.page_keys = ((req.prefill_target, limit), keys)
        return req.page_keys[1]

    def match(self, req: Request) -> PrefixMatch | None:
        """The cached prefix an admitted request can reuse (or, hybrid, only a branch point), or None."""
        match = self.cache.match_prefix(keys=self._keys(req))
        return match if match.pages or match.branch else None

    @staticmethod
    def waits_for_snapshot(match: PrefixMatch | None) -> bool:
        """Hybrid: a snapshot that the step being planned takes covers more of this prompt than any
        loadable one. Admitted now, the request would recompute that prefix; a step later it loads it."""
        return match is not None and match.pending > match.num_tokens

    def shared_with(self, req: Request, others) -> int:
        """Tokens (whole pages) of req's prompt that one of the `others` (waiting requests) starts
        with too. Hybrid: req's first chunk ends there, so its snapshot serves them (in-batch
        prefix sharing: SGLang defers such requests by a step as well)."""
        keys, best = self._keys(req), 0
        if not keys:
            return 0
        for other in others:
            theirs = self._keys(other)
            if not theirs or theirs[0] != keys[0]:
                continue
            n = 1
            stop = min(len(keys), len(theirs))
            while n < stop and keys[n] == theirs[n]:
                n += 1
            best = max(best, n)
        return best * self.cache.page_size

    def order(self, waiting: deque) -> deque:
        """LPM: the waiting queue by cached prefix length, longest first (a stable sort)."""
        def cached(req: Request) -> int:
            match = self.match(req)
            return 0 if match is None else match.num_tokens
        return deque(sorted(waiting, key=cached, reverse=True))

    def reuse(self, req: Request, match: PrefixMatch, updates: list) -> None:
        """Map the matched pages into the request's page-table row; it prefills from there."""
        self.pages.share(match.pages)
        for i, p in enumerate(match.pages):
            updates.append((req.slot, i, p))
        req.pages = list(match.pages)
        req.kv_len = match.num_tokens
        req.cached_tokens = max(req.cached_tokens, match.num_tokens)
        req.cache_node = match.node
        if match.state is not None:
            self.cache.loading.add(match.node)  # its row is read by this step: not reassigned in it
            match.node.unproven = False  # an inner snapshot loaded once is kept like any other

    def chunk_dispatched(self, req: Request) -> int:
        """A prompt chunk was planned (the request's kv_len now ends it): its full pages join the
        tree and the request locks the deepest node it now reads. Returns the snapshot row the
        state at the chunk's end goes to (hybrid: where it ends on a page boundary whose node has
        none yet), or -1."""
        cache, end = self.cache, req.kv_len
        cache.insert(req.all_ids, req.pages, end)
        node = cache.path_end(req.all_ids, end)
        cache.lock(node)
        if req.cache_node is not None:
            cache.unlock(req.cache_node)
        req.cache_node = node
        if not cache.stateful or node.depth * self.pages.page_size != end or node.state is not None:
            return -1
        row = cache.alloc_state()
        if row is None:
            return -1
        cache.attach_state(node, row)
        return row

    def inner_snapshots(self, req: Request, start: int, interval: int) -> list[tuple[int, int]]:
        """Hybrid: the snapshots a prompt chunk from `start` to req.kv_len (its pages in the tree
        already) takes inside itself, as (k, row): the state after its first k tokens goes to the
        row. Candidates are the ends of the kernel's 64-token chunks of this chunk (k a multiple of
        64, short of its end) that fall on a page boundary; one is taken at the first candidate at or
        past each multiple of `interval` after start, where its node has no snapshot yet and a row can
        be had without dropping a snapshot that is not itself an unproven inner one."""
        cache, ps, end = self.cache, self.pages.page_size, req.kv_len
        if not cache.stateful:
            return []
        points, done = [], start // interval  # done: the last multiple of interval already covered
        for p in range(start + GDN_CHUNK, end, GDN_CHUNK):
            if p % ps == 0 and p // interval > done:
                points.append(p)
                done = p // interval
        if not points:
            return []
        nodes, node = [], cache.path_end(req.all_ids, points[-1])  # one walk down, then up by parents
        for p in reversed(points):
            while node.depth * ps > p:
                node = node.parent
            nodes.append((p, node))
        out = []
        for p, node in reversed(nodes):
            if node.depth * ps != p or node.state is not None:
                continue
            row = cache.alloc_state(inner=True)
            if row is None:
                break
            cache.attach_state(node, row, inner=True)
            out.append((p - start, row))
        return out

    def track(self, req: Request) -> int:
        """Hybrid, plain decode: the row the state after this decode step (req.kv_len tokens, a
        page boundary) is copied to, or -1; the request keeps only its newest such row, which joins
        the tree at its release. Rows of older tracks go back at once: the steps that wrote them
        ran first, and nothing loads a row before it joins the tree."""
        row = self.cache.alloc_state()
        if row is None:
            return -1
        if req.track is not None:
            self.cache.release_state(req.track[1])
        req.track = (req.kv_len, row)
        return row

    def spec_track(self, req: Request, interval: int, max_accept: int) -> tuple[int, int] | None:
        """Hybrid, speculative decode: (boundary, row) for this step. The device copies the state at
        the request's next multiple of `interval` into the row in the step whose accepted run passes
        it (the step's steps before it may accept up to max_accept tokens each, unknown here). A
        pending track is taken only while no step in flight can have passed its boundary, and then
        rides on every step until `spec_tracked` sees the length pass it, so exactly one step fills it."""
        if req.track_pending is None:
            boundary = (req.kv_len // interval + 1) * interval
            reached = req.kv_len + req.spec_inflight * max_accept  # the most its steps in flight reach
            if reached >= boundary or reached + max_accept < boundary:
                return None
            row = self.cache.alloc_state()
            if row is None:
                return None
            req.track_pending = (boundary, row)
        return req.track_pending

    def spec_tracked(self, req: Request) -> None:
        """A speculative step's results were read: a pending track whose boundary the request's
        known length passed holds that state now and becomes its newest (the older one's row goes)."""
        pending = req.track_pending
        if pending is not None and req.kv_len >= pending[0]:
            req.track_pending = None
            if req.track is not None:
                self.cache.release_state(req.track[1])
            req.track = pending

    def release(self, req: Request) -> None:
        """The request ends (finish, abort, retraction): the full pages of what it computed join the
        tree, and its lock goes. Only KV below the known length: a speculative step in flight writes
        (target KV, draft KV, NGRAM history) only at and past the device's length, which is never
        below kv_len, so the pages below kv_len are final even then."""
        computed = min(req.kv_len, len(req.all_ids))
        if req.pages:
            self.cache.insert(req.all_ids, req.pages, computed)
        self.spec_tracked(req)
        if req.track_pending is not None:  # not reached: a step in flight may still fill it, unread
            self.cache.release_state(req.track_pending[1])
            req.track_pending = None
        if req.track is not None:  # the newest decode-time state, at its node if that is cached
            at, row = req.track
            req.track = None
            node = self.cache.path_end(req.all_ids, min(at, computed))
            if node.depth * self.pages.page_size == at:
                self.cache.attach_state(node, row)
            else:
                self.cache.release_state(row)
        if req.cache_node is not None:
            self.cache.unlock(req.cache_node)
            req.cache_node = None
