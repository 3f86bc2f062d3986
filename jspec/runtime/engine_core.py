"""The host loop: schedule -> dispatch -> (one step later, in overlap mode) read tokens -> stop checks.

Overlap (the default): step N+1 is dispatched before step N's tokens are read, so the host's
bookkeeping, detokenization and stop checks run while the device computes. The only device-to-host
transfer in the loop is each step's small output matrix, copied asynchronously at dispatch.
A request that stops at step N may already be in step N+1: that row's token is dropped.
"""

from __future__ import annotations

import threading
import time
from collections import deque

from jspec.models.batch import ForwardMode
from jspec.runtime import gc_heap, outputs
from jspec.runtime.adaptive import SpecPolicy
from jspec.runtime.detokenizer import DetokState, Detokenizer, first_stop
from jspec.runtime.model_runner import ModelRunner, StepHandle
from jspec.runtime.request import Request, top_rows
from jspec.runtime.scheduler import NeedSync, Scheduler
from jspec.runtime.step_inputs import unpack_outputs


class EngineCore:
    def __init__(self, runner: ModelRunner, scheduler: Scheduler, *, tokenizer, eos_token_ids, overlap: bool,
                 policy: SpecPolicy | None = None):
        self.runner, self.sched = runner, scheduler
        self.policy = policy  # a speculative engine's per-step choice (None: always speculate)
        self.detok = Detokenizer(tokenizer)
        self.eos = set(eos_token_ids)
        self.overlap = overlap
        self.pending: StepHandle | None = None
        # A step being dispatched: its `between` may read the step in flight and finish the last
        # request before the runner holds the new device state again, so the loop is not idle yet.
        self.dispatching = False
        self.inbox: deque[Request] = deque()
        self.requests: dict[str, Request] = {}
        self.lock = threading.RLock()
        self.num_steps = {"extend": 0, "decode": 0, "spec": 0}
        self.num_generated = 0
        self.accept_histogram: dict[int, int] = {}  # tokens produced per verify -> how often
        self.flush_waiters: list[tuple[threading.Event, dict]] = []  # flush_cache calls to answer

    # ------------------------------------------------------------------ called from any thread
    def submit(self, req: Request) -> None:
        with self.lock:
            self.requests[req.rid] = req
            self.inbox.append(req)

    def request_flush(self, timeout: float, wake) -> bool:
        """Ask the loop to drop the prefix cache (wake: rouses an idle loop); True once done,
        False if requests were running (SGLang refuses a flush then too) or no answer in time."""
        done, box = threading.Event(), {}
        with self.lock:
            self.flush_waiters.append((done, box))
        wake()
        return done.wait(timeout) and box.get("ok", False)

    def abort(self, rid: str, message: str = "aborted by user") -> bool:
        with self.lock:
            req = self.requests.get(rid)
        if req is None or req.finished:
            return False
        req.aborted = message
        return True

    # ------------------------------------------------------------------ loop thread only
    def has_work(self) -> bool:
        return (bool(self.inbox) or self.sched.has_work() or self.pending is not None or self.dispatching
                or bool(self.flush_waiters))

    def _answer_flushes(self) -> None:
        with self.lock:
            waiters, self.flush_waiters = self.flush_waiters, []
        idle = not self.inbox and not self.sched.has_work() and self.pending is None
        ok = idle and self.sched.cache is not None and self.sched.cache.flush()
        for done, box in waiters:
            box["ok"] = ok
            done.set()

    def step(self) -> None:
        """One turn of the loop; the streams it signals wake their readers at its end, at once
        (`outputs.batched_signals`)."""
        with outputs.batched_signals():
            self._step()

    def _step(self) -> None:
        if self.flush_waiters:
            if self.pending is not None and not self.inbox and not self.sched.has_work():
                self._process(self.pending)  # a step left in flight after the last finish: idle once read
                self.pending = None
            self._answer_flushes()
        with self.lock:
            while self.inbox:
                req = self.inbox.popleft()
                if req.sampling.max_new_tokens == 0 and req.logprob_start_len < 0:
                    self._finish(req, {"type": "length", "length": 0})  # nothing to compute
                else:
                    self.sched.add(req)
        self._handle_aborts()
        try:
            plan = self.sched.schedule(inflight=self.pending is not None)
        except NeedSync:
            self._process(self.pending)
            self.pending = None
            self._handle_aborts()
            plan = self.sched.schedule(inflight=False)
        handle = None
        self.dispatching = plan is not None
        try:
            if plan is not None:
                if plan.mode is ForwardMode.DECODE and self.policy is not None:
                    n = len(plan.reqs)
                    k = self.policy.choose(self.runner.decode_batch_size(n), n)
                    plan.speculate, plan.draft_steps = k > 0, (k if 0 < k < self.policy.max_drafts else 0)
                handle = self.runner.dispatch(plan, between=self._read_pending if self._grammar_waits(plan) else None)
                self.num_steps[self._step_kind(handle)] += 1
            if self.overlap:
                if self.pending is not None:
                    self._process(self.pending)
                self.pending = handle
            elif handle is not None:
                self._process(handle)
        finally:
            self.dispatching = False

    def _grammar_waits(self, plan) -> bool:
        """Whether a constrained request samples in plan after sampling in the step in flight: its
        masks depend on that token (its grammar must consume it first), so the runner reads that
        step (`_read_pending`) before it fills them, after launching whatever of plan does not need
        them. A prompt chunk's first token depends on nothing in flight, and launches at once."""
        if self.pending is None:
            return False
        inflight = {id(s.req) for s in self.pending.plan.reqs if s.sample and s.req.grammar is not None}
        return any(s.sample and id(s.req) in inflight for s in plan.reqs)

    def _read_pending(self) -> None:
        self._process(self.pending)
        self.pending = None
        self._handle_aborts()

    def _handle_aborts(self) -> None:
        for req in list(self.sched.waiting) + list(self.sched.running):
            if req.aborted is not None and not req.finished:
                self._finish(req, {"type": "abort", "message": req.aborted})

    def fail_all(self, message: str) -> None:
        """A step raised: finish every request with an abort naming the error, free everything."""
        self.pending = None
        for req in list(self.sched.waiting) + list(self.sched.running) + list(self.inbox):
            self._finish(req, {"type": "abort", "message": message})
        self.inbox.clear()

    def release(self) -> None:
        """Free the output buffer of a step still in flight (after the loop has stopped)."""
        if self.pending is not None and not self.pending.out.is_deleted():
            self.pending.out.delete()
        self.pending = None

    # ------------------------------------------------------------------ results
    def _step_kind(self, handle: StepHandle) -> str:
        """"extend", "decode" or "spec" (a speculative engine's decode step that speculated)."""
        if handle.bucket.mode is ForwardMode.DECODE and self.runner.speculative and handle.bucket.speculate:
            return "spec"
        return handle.bucket.mode.value

    @gc_heap.paused()  # a step's logprob rows are built in bulk: one young collection after them
    def _process(self, handle: StepHandle) -> None:
        if handle.bucket.mode is ForwardMode.DECODE and self.runner.speculative:
            return self._process_spec(handle)
        out = self.runner.fetch(handle)
        if handle.bucket.input_logprobs:
            self._input_logprobs(handle, out[handle.bucket.batch_size:])
        tokens, logprobs, top_ids, top_lps = unpack_outputs(out, self.runner.num_top)
        now = time.perf_counter()
        for i, s in enumerate(handle.plan.reqs):
            req = s.req
            if not s.sample or req.finished:
                continue
            if req.sampling.max_new_tokens == 0:  # it ran for its prompt's logprobs (scoring) only
                self._finish(req, {"type": "length", "length": 0})
                continue
            tok = int(tokens[i])
            req.output_ids.append(tok)
            self.num_generated += 1
            req.token_times.append(now)
            if req.first_token_time is None:
                req.first_token_time = now
            if req.return_logprob:
                req.output_logprobs.append(float(logprobs[i]))
                n = req.top_logprobs_num
                req.output_top_logprobs += top_rows([top_lps[i, :n].tolist()], [top_ids[i, :n].tolist()])
            reason = self._stop_reason(req, tok)
            if reason is not None:
                self._finish(req, reason)
            elif req.stream_queue is not None:
                req.stream_queue.put(False)

    def _input_logprobs(self, handle: StepHandle, rows) -> None:
        """A prompt step's per-token rows: position p holds the logprob of prompt token p + 1; each
        request keeps those it asked for, once (a retracted request computes them again)."""
        _, logprobs, top_ids, top_lps = unpack_outputs(rows, self.runner.num_top)
        t = 0
        for s in handle.plan.reqs:
            req = s.req
            k = req.input_logprob_next  # the prompt token it needs next, predicted at position k - 1
            if s.token_ids is not None and not req.finished and s.start <= k - 1 < s.start + s.num_tokens:
                end = min(len(req.input_ids), s.start + s.num_tokens + 1)  # prompt tokens this chunk predicts
                i, j, n = t + k - 1 - s.start, t + end - 1 - s.start, req.top_logprobs_num
                req.input_logprobs += logprobs[i:j].tolist()  # one conversion per chunk, not per token
                if n:  # rows built by the reader (`Request.input_top_rows`), not between two steps here
                    req.input_top_pending.append((top_lps[i:j, :n].copy(), top_ids[i:j, :n].copy()))
            t += s.num_tokens

    def _process_spec(self, handle: StepHandle) -> None:
        """A verify step's row: [count, tokens...]. Tokens are taken one by one so a stop condition
        (or max_new_tokens) inside the accepted run truncates it; the request's known KV length then
        moves by what was accepted (the bonus token becomes the next input). With overlap the next
        step is already on the device: it found the new length there, not here."""
        counts, tokens, logprobs, top_ids, top_lps = self.runner.spec_rows.unpack(self.runner.fetch(handle))
        now = time.perf_counter()
        speculated = handle.bucket.speculate  # else a plain step: one token per row, same row format
        if speculated and self.policy is not None:
            self.policy.observe([int(c) for c in counts[:len(handle.plan.reqs)] if c > 0],
                                handle.bucket.draft_steps or None)
        for i, s in enumerate(handle.plan.reqs):
            req = s.req
            if req.finished or req.slot is None:
                continue  # finished (or retracted) after this step was dispatched: drop its row
            req.spec_inflight -= 1
            count = int(counts[i])
            req.spec_verify_ct += 1  # every target forward over the request, with or without drafts
            if speculated:
                self.accept_histogram[count] = self.accept_histogram.get(count, 0) + 1
            reason = None
            row = tokens[i, :count].tolist()  # Python ints and floats at once, not per element
            if req.return_logprob:
                k = req.top_logprobs_num
                lps = logprobs[i, :count].tolist()
                top = top_rows(top_lps[i, :count, :k].tolist(), top_ids[i, :count, :k].tolist())
            for j, tok in enumerate(row):
                req.output_ids.append(tok)
                req.token_times.append(now)
                self.num_generated += 1
                if req.return_logprob:
                    req.output_logprobs.append(lps[j])
                    req.output_top_logprobs.append(top[j])
                reason = self._stop_reason(req, tok)
                if reason is not None:
                    break
            self.sched.accepted(req, count)  # the KV below the new length is final, also past a stop
            if reason is not None:
                self._finish(req, reason)
                continue
            req.scheduled_outputs = len(req.output_ids)
            if req.stream_queue is not None:
                req.stream_queue.put(False)

    def _stop_reason(self, req: Request, tok: int) -> dict | None:
        sp = req.sampling
        if req.grammar is not None:
            if not req.grammar.accept(tok):
                return {"type": "abort", "message": f"token {tok} broke the request's grammar: {req.grammar.error}"}
            if req.grammar.finished:  # the grammar ended (SGLang finishes the request there too)
                return {"type": "stop", "matched": tok}
        early = len(req.output_ids) < sp.min_new_tokens  # no stop counts yet (the device held back stop tokens)
        if not early and not sp.ignore_eos and tok in self.eos:
            return {"type": "stop", "matched": tok}
        if not early and sp.stop_token_ids and tok in sp.stop_token_ids:
            return {"type": "stop", "matched": tok}
        if sp.stop or sp.stop_regex:  # a stream without stops is decoded by its reader (outputs.StreamChunks)
            if req.detok_state is None:
                req.detok_state = DetokState()
            state = req.detok_state
            before = len(state.text)
            self.detok.step(state, req.output_ids, sp.skip_special_tokens)
            if not early:
                hit = first_stop(state.text, sp.stop or (), sp.stop_regex or (), before)
                if hit is not None:
                    req.stop_text_end = None if sp.no_stop_trim else hit[0]
                    return {"type": "stop", "matched": hit[1]}
        if len(req.output_ids) >= sp.max_new_tokens:
            return {"type": "length", "length": sp.max_new_tokens}
        return None

    def _finish(self, req: Request, reason: dict) -> None:
        self.sched.finish(req, reason)
        if req.finish_reason is None:  # finished before it was ever scheduled
            req.finish_reason = reason
        req.finish_time = time.perf_counter()
        with self.lock:
            self.requests.pop(req.rid, None)
        if req.stream_queue is not None:
            req.stream_queue.put(True)
        req.done.set()
