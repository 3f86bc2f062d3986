"""Continuous batching on the host: admission, chunked prefill, decode, retraction, finishing.

Each call to `schedule` plans one step. Policy:
- FCFS: waiting requests are admitted in arrival order and never skipped (no starvation); a
  retracted request goes back to the front of the queue. With `schedule_policy="lpm"` (SGLang's
  longest-prefix-match) the queue is first ordered by how many prompt tokens the prefix cache holds,
  longest first, arrival order among equals, so requests of one prefix group run together while
  their pages are cached; the queue is then admitted in that order, never skipped.
- Chunked prefill: a step's extend tokens stay within `chunked_prefill_size`; a prompt longer than
  that is fed over several steps, continuing before anything new is admitted.
- Prefill and decode alternate while both have work, so neither starves the other (decode-only
  steps use the decode kernel). With `enable_mixed_chunk` (SGLang's name) decodes instead ride
  along in every extend step as one-token rows. With `prefill_first` a prompt-chunk step runs
  whenever a prompt can advance, decode only when none can (SGLang's order): first tokens come
  sooner when many prompts arrive at once, while the running requests wait.
- Pages are allocated at dispatch for exactly the tokens a step writes; when decode needs a page
  and none is free, unused prefix-cache pages are evicted first, then the most recently admitted
  request is retracted (its pages and slot freed, its prompt + outputs re-queued to be prefilled
  again) instead of failing. Unfinished prompts that between them hold the whole pool (none can
  take its next chunk, nothing decodes) are resolved the same way.
- Prefix cache (`jspec.cache.radix_cache`, when given; `prefix_reuse.py`): an admitted request
  reuses the cached pages of its longest page-aligned prefix (hybrid targets: up to a GDN state
  snapshot) and prefills from there; at most `prefix_pages_per_step` cached pages are mapped per
  step (the page-table updates an extend bucket carries).

The scheduler never reads the device: in overlap mode a step is planned from host bookkeeping
alone (lengths advance deterministically), and results arrive one step later.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections import deque

from jspec.cache.allocator import PageAllocator, SlotAllocator
from jspec.cache.radix_cache import RadixCache
from jspec.models.batch import ForwardMode
from jspec.runtime.prefix_reuse import PrefixReuse
from jspec.runtime.request import Request, Status
from jspec.runtime.step_inputs import TRACKS_PER_STEP

# LPM orders the waiting queue by a tree walk per request each prompt step: beyond this many waiting
# requests admission falls back to FCFS (SGLang's cutoff), which bounds that host time.
LPM_MAX_WAITING = 128
# Hybrid prefix cache: waiting requests a newly admitted prompt is compared with for a shared prefix
# (its first chunk then ends there, leaving a snapshot), and waiting requests skipped per step
# because such a snapshot, taken this step, serves them from the next: both bound host time.
SHARED_PREFIX_SCAN = 64
MAX_DEFERRED = 128


@dataclasses.dataclass
class ScheduledReq:
    req: Request
    start: int  # KV index of the first token in this step
    token_ids: list[int] | None  # None: the single input token is the device's last sampled token
    sample: bool  # this step samples the request's next output token
    reset: bool  # first chunk after (re)admission: clear the slot's penalty state
    output_index: int  # index of the sampled token in the request's output
    state_load: int = -1  # hybrid prefix cache: the snapshot row copied into the slot before the step
    state_save: int = -1  # ... and the row the slot's state is copied to after it (a snapshot)
    # ... and inside the chunk: (k, row), the state after its first k tokens into the row
    inner_snapshots: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    track: tuple[int, int] | None = None  # speculative DECODE: (boundary length, snapshot row) to fill if passed
    # Admitted on a cached prefix with a repetition penalty: instead of a reset, the slot's penalty
    # state is seeded with the cached prompt tokens before the step (`sampler.seed_slot`).
    seed_prompt: bool = False

    @property
    def num_tokens(self) -> int:
        return 1 if self.token_ids is None else len(self.token_ids)


@dataclasses.dataclass
class StepPlan:
    mode: ForwardMode  # EXTEND (prompt chunks, mixed decodes) or DECODE
    reqs: list[ScheduledReq]
    page_updates: list[tuple[int, int, int]]  # (slot, page index in the request, page id)
    speculate: bool = True  # a speculative engine's DECODE step: False decodes plainly (runtime.adaptive)
    draft_steps: int = 0  # ... and > 0 drafts that many tokens, fewer than configured (0: as configured)
    tracks: list[tuple[int, int]] = dataclasses.field(default_factory=list)  # DECODE: (slot, snapshot row)
    input_logprobs: bool = False  # EXTEND: a chunk computes input token logprobs a request asked for

    @property
    def num_tokens(self) -> int:
        return sum(r.num_tokens for r in self.reqs)


class NeedSync(Exception):
    """Planning needs the results of in-flight steps first (retraction)."""


class Scheduler:
    def __init__(self, pages: PageAllocator, slots: SlotAllocator, *, max_running_requests: int,
                 chunked_prefill_size: int, max_extend_requests: int, max_decode_requests: int,
                 enable_mixed_chunk: bool = False, spec_tokens: int = 0, spec_max_accept: int = 0,
                 prefill_ahead: int = 0, radix_cache: RadixCache | None = None, prefix_pages_per_step: int = 0,
                 schedule_policy: str = "fcfs", track_interval: int = 0, prefill_first: bool = False):
        self.pages, self.slots = pages, slots
        self.max_running = max_running_requests
        self.chunk_budget = chunked_prefill_size
        self.max_extend_requests = max_extend_requests
        self.max_decode_requests = max_decode_requests
        self.mixed = enable_mixed_chunk
        self.prefill_first = prefill_first
        # Speculative decode: each decode step writes KV for `spec_tokens` positions per request and
        # produces up to `spec_max_accept` tokens, a number known only from its results. With steps in
        # flight the host does not know a request's length yet, so it plans pages for the longest one.
        self.spec_tokens = spec_tokens
        self.spec_max_accept = spec_max_accept
        self.ahead = spec_tokens or 1
        # KV indices a prompt's last chunk writes past the prompt (DFlash drafts its first block there).
        self.prefill_ahead = prefill_ahead
        self.num_mixed_decode_rows = 0
        self.cache = radix_cache
        self.reuse = None if radix_cache is None else PrefixReuse(radix_cache, pages)
        # Hybrid: the GDN state is kept whenever a request's length reaches a multiple of
        # track_interval (0: never), so what it generated can be reused with its state.
        self.track_interval = track_interval if radix_cache is not None and radix_cache.stateful else 0
        self.prefix_pages_per_step = prefix_pages_per_step
        self.lpm = schedule_policy == "lpm" and radix_cache is not None
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self._admitted = 0
        self._last_mode = ForwardMode.DECODE
        self.num_retractions = 0

    # ----------------------------------------------------------------------------- queues
    def add(self, req: Request) -> None:
        req.prefill_target = len(req.input_ids)
        self.waiting.append(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _decodable(self) -> list[Request]:
        return [r for r in self.running
                if not r.in_prefill and not r.finished and r.scheduled_outputs < r.sampling.max_new_tokens]

    # ----------------------------------------------------------------------------- planning
    def schedule(self, *, inflight: bool) -> StepPlan | None:
        prefill_pending = bool(self.waiting) or any(r.in_prefill for r in self.running)
        decodable = self._decodable()
        if prefill_pending and (self.mixed or self.prefill_first or not decodable
                                or self._last_mode is ForwardMode.DECODE):
            plan = self._plan_extend(decodable)
            if plan is not None:
                self._last_mode = ForwardMode.EXTEND
                return plan
        if decodable:
            self._last_mode = ForwardMode.DECODE
            return self._plan_decode(decodable, inflight)
        if sum(r.in_prefill for r in self.running) > 1:
            # Only unfinished prompts run, and none can grow: between them they hold the pool (each
            # fits alone, not all at once). The newest goes back to the queue so the others finish.
            if inflight:
                raise NeedSync()
            self.retract(max(self.running, key=lambda r: r.admit_order))
            return self.schedule(inflight=inflight)
        return None

    def _make_room(self, num_pages: int) -> bool:
        """Whether num_pages pages are free, evicting unused prefix-cache pages if that helps."""
        if num_pages > self.pages.num_free and self.cache is not None:
            self.cache.evict(num_pages - self.pages.num_free)
        return num_pages <= self.pages.num_free

    def _grow(self, req: Request, new_kv_len: int, updates: list) -> bool:
        """Give `req` pages for `new_kv_len` tokens; False (nothing allocated) if the pool is short."""
        need = self.pages.pages_for(new_kv_len) - len(req.pages)
        if need <= 0:
            return True
        if not self._make_room(need):
            return False
        for p in self.pages.alloc(need):
            updates.append((req.slot, len(req.pages), p))
            req.pages.append(p)
        return True

    def _chunk(self, req: Request, budget: int, updates: list, *, reset: bool, load: int = -1) -> ScheduledReq | None:
        n = min(req.prefill_target - req.kv_len, budget)
        start = req.kv_len
        if req.branch_at > start:  # hybrid: end this chunk where a snapshot is wanted
            n = min(n, req.branch_at - start)
        sample = start + n == req.prefill_target
        if n <= 0 or not self._grow(req, start + n + (self.prefill_ahead if sample else 0), updates):
            return None
        req.kv_len += n
        save = -1 if self.reuse is None else self.reuse.chunk_dispatched(req)
        out_index = req.scheduled_outputs
        if sample:
            req.scheduled_outputs += 1
        return ScheduledReq(req, start, req.all_ids[start:start + n], sample, reset, out_index,
                            state_load=load, state_save=save)

    def _branch_at(self, req: Request, match) -> int:
        """Hybrid prefix cache: where an admitted request's first chunk ends so that a snapshot is
        taken there (0: nowhere): the point its pages matched past every snapshot (recomputed now,
        reused later), else the longest prefix it shares with a waiting request."""
        if self.cache is None or not self.cache.stateful:
            return 0
        if match is not None and match.branch > match.num_tokens:
            return match.branch
        shared = self.reuse.shared_with(req, itertools.islice(self.waiting, SHARED_PREFIX_SCAN))
        return shared if shared > (0 if match is None else match.num_tokens) else 0

    def _plan_extend(self, decodable: list[Request]) -> StepPlan | None:
        budget, updates, chosen = self.chunk_budget, [], []
        if self.cache is not None:  # snapshots this step takes (continued prompts too) load next step on
            self.cache.begin_step()
        # Pages the decoding requests will need next step: keep them free when admitting.
        reserve = sum(max(0, self.pages.pages_for(self._kv_bound(r)) - len(r.pages)) for r in decodable)
        for req in self.running:  # continue prompts already started
            if req.in_prefill and budget > 0 and len(chosen) < self.max_extend_requests:
                s = self._chunk(req, budget, updates, reset=False)
                if s is not None:
                    chosen.append(s)
                    budget -= s.num_tokens
        prefix_budget, admitted = self.prefix_pages_per_step, 0
        if self.lpm and 1 < len(self.waiting) <= LPM_MAX_WAITING:
            self.waiting = self.reuse.order(self.waiting)
        deferred = []  # hybrid: waiting for a snapshot this step takes (order kept)
        while (self.waiting and budget > 0 and len(chosen) < self.max_extend_requests
               and len(self.running) < self.max_running):
            req = self.waiting[0]
            match = None if self.reuse is None else self.reuse.match(req)
            if self.reuse is not None and self.reuse.waits_for_snapshot(match):
                if len(deferred) == MAX_DEFERRED:
                    break
                deferred.append(self.waiting.popleft())
                continue
            if match is not None and len(match.pages) > prefix_budget:
                if admitted:
                    break  # its cached pages do not fit this step's page-table updates: next step
                match = self.cache.truncate(match, prefix_budget)
            cached = 0 if match is None else match.num_tokens
            first = cached + min(req.prefill_target - cached, budget)
            first += self.prefill_ahead if first == req.prefill_target else 0
            need = self.pages.pages_for(first) - (0 if match is None else len(match.pages))
            if match is not None:
                self.cache.lock(match.node)  # not evicted while it makes room below
            if self.slots.num_free == 0 or not self._make_room(need + reserve):
                if match is not None:
                    self.cache.unlock(match.node)
                break  # FCFS: wait for room rather than let a later request jump ahead
            req.slot = self.slots.alloc()
            self.waiting.popleft()
            req.branch_at = self._branch_at(req, match)  # before its page keys go
            req.page_keys = None
            req.status = Status.RUNNING
            self._admitted += 1
            req.admit_order = self._admitted
            self.running.append(req)
            admitted += 1
            if self.cache is not None:
                self.cache.count(req.prefill_target, 0 if match is None else match.num_tokens)
            load = -1
            if match is not None:
                if match.pages:
                    self.reuse.reuse(req, match, updates)
                    prefix_budget -= len(match.pages)
                    load = -1 if match.state is None else match.state
                else:
                    self.cache.unlock(match.node)
            s = self._chunk(req, budget, updates, reset=True, load=load)
            assert s is not None
            if s.start > 0 and req.sampling.repetition_penalty != 1.0:
                s.reset, s.seed_prompt = False, True
            chosen.append(s)
            budget -= s.num_tokens
        self.waiting.extendleft(reversed(deferred))
        if self.track_interval:
            # Snapshots inside the chunks only after every chunk of the step has its chunk-end and
            # branch snapshot: they take what rows are left, never one of those.
            for s in chosen:
                s.inner_snapshots = self.reuse.inner_snapshots(s.req, s.start, self.track_interval)
        if self.mixed:
            # Mixed chunk: running decodes ride along as one-token rows of the extend step, so a
            # long prefill never stalls them (their input token comes from the device buffer).
            for req in sorted(decodable, key=lambda r: r.admit_order):
                if budget <= 0 or len(chosen) >= self.max_extend_requests:
                    break
                if not self._grow(req, req.kv_len + 1, updates):
                    break  # out of pages: a decode step (which can retract) handles the rest
                chosen.append(ScheduledReq(req, req.kv_len, None, True, False, req.scheduled_outputs))
                req.kv_len += 1
                req.scheduled_outputs += 1
                budget -= 1
                self.num_mixed_decode_rows += 1
        if not chosen:
            return None
        return StepPlan(ForwardMode.EXTEND, chosen, updates,
                        input_logprobs=any(s.token_ids is not None and s.req.wants_input_logprobs(s.start, s.num_tokens)
                                           for s in chosen))

    def _plan_decode(self, decodable: list[Request], inflight: bool) -> StepPlan | None:
        decodable = sorted(decodable, key=lambda r: r.admit_order)[: self.max_decode_requests]
        need = sum(max(0, self.pages.pages_for(self._kv_bound(r)) - len(r.pages)) for r in decodable)
        while not self._make_room(need):
            if inflight:
                raise NeedSync()
            victim = max(self.running, key=lambda r: r.admit_order)
            if victim in decodable:
                decodable.remove(victim)
                need -= max(0, self.pages.pages_for(self._kv_bound(victim)) - len(victim.pages))
            self.retract(victim)
            if not decodable:
                return None
        updates, chosen, tracks = [], [], []
        for req in decodable:
            ok = self._grow(req, self._kv_bound(req), updates)
            assert ok
            chosen.append(ScheduledReq(req, req.kv_len, None, True, False, req.scheduled_outputs))
            if self.spec_tokens:
                if self.track_interval:
                    chosen[-1].track = self.reuse.spec_track(req, self.track_interval, self.spec_max_accept)
                req.spec_inflight += 1  # its length is known again when this step is processed
            else:
                req.kv_len += 1
                req.scheduled_outputs += 1
                if self.track_interval and req.kv_len % self.track_interval == 0 and len(tracks) < TRACKS_PER_STEP:
                    row = self.reuse.track(req)
                    if row >= 0:
                        tracks.append((req.slot, row))
        return StepPlan(ForwardMode.DECODE, chosen, updates, tracks=tracks)

    def accepted(self, req: Request, count: int) -> None:
        """A speculative step's results for `req` were read: its known KV length moves by `count`
        (the accepted drafts and the last input; the bonus is the next input)."""
        req.kv_len += count
        if self.track_interval:
            self.reuse.spec_tracked(req)

    def _kv_bound(self, req: Request) -> int:
        """KV indices the request's next decode step may write: its known length, plus the most its
        steps still in flight can accept, plus what the step itself writes ahead."""
        return req.kv_len + req.spec_inflight * self.spec_max_accept + self.ahead

    # ----------------------------------------------------------------------------- resources
    def _release(self, req: Request) -> None:
        if self.reuse is not None:
            self.reuse.release(req)
        if req.pages:
            self.pages.free(req.pages)
            req.pages = []
        if req.slot is not None:
            self.slots.free(req.slot)
            req.slot = None

    def retract(self, req: Request) -> None:
        """Preempt a running request: free everything, re-queue it first, to recompute later."""
        self._release(req)
        self.running.remove(req)
        req.status = Status.WAITING
        req.kv_len = 0
        req.branch_at = 0
        req.spec_inflight = 0
        req.prefill_target = len(req.all_ids)
        req.scheduled_outputs = len(req.output_ids)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting.appendleft(req)

    def finish(self, req: Request, reason: dict) -> None:
        if req.finished:
            return
        self._release(req)
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        req.status = Status.FINISHED
        req.finish_reason = reason
