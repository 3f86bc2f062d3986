"""What a request returns to its caller: its text, SGLang's `meta_info` fields, and the chunks of a
streamed request, built on the caller's thread from the request the engine loop fills in."""

from __future__ import annotations

import asyncio
import contextlib
import threading
import time

from jspec.runtime import gc_heap
from jspec.runtime.detokenizer import DetokState, Detokenizer, safe_prefix
from jspec.runtime.request import Request


def text(detok: Detokenizer, req: Request) -> str:
    """The output decoded; cut before the stop string or stop-regex match that finished it, if one
    did (unless the request keeps it: `no_stop_trim`)."""
    out = detok.decode(req.output_ids, req.sampling.skip_special_tokens)
    if req.stop_text_end is not None:
        out = (req.detok_state.text if req.detok_state is not None else out)[:req.stop_text_end]
    return out


class _LogprobRows:
    """A streamed request's logprob entries in meta_info's format, each built once as the stream
    goes: every chunk carries them all (SGLang's cumulative meta_info), and rebuilding them at
    every chunk is quadratic in the output, and costs the prompt's length (times its top
    logprobs) per chunk when the request asked for its input logprobs."""

    def __init__(self):
        self.tokens: list = []
        self.input_tokens: list = []
        self.input_top: list = []

    @gc_heap.paused()  # rows built in bulk (gc_heap: why)
    def update(self, req: Request) -> tuple[list, list]:
        n = len(self.tokens)
        self.tokens += [(lp, t, None) for lp, t in zip(req.output_logprobs[n:], req.output_ids[n:])]
        # The top rows are built by the engine in this format: a copy of as many as there are tokens.
        return list(self.tokens), req.output_top_logprobs[:len(self.tokens)]

    @gc_heap.paused()
    def update_input(self, req: Request) -> tuple[list, list]:
        """The prompt's rows from logprob_start_len on. They grow while the prompt is prefilled in
        chunks and then stay, so every chunk after the prompt gets the same two lists, not copies
        (a copy per chunk of a long prompt's rows is host time in every decode step)."""
        n = len(self.input_tokens)
        top = req.input_top_rows()
        if n == len(req.input_logprobs) and len(self.input_top) == len(top):
            return self.input_tokens, self.input_top
        ids = req.input_ids[req.logprob_start_len + n:]
        self.input_tokens = self.input_tokens + [(lp, t, None) for lp, t in zip(req.input_logprobs[n:], ids)]
        self.input_top = self.input_top + top[len(self.input_top):]
        return self.input_tokens, self.input_top


def meta_info(req: Request, *, speculative: bool, rows: _LogprobRows | None = None) -> dict:
    meta = {
        "id": req.rid,
        "prompt_tokens": len(req.input_ids),
        "completion_tokens": len(req.output_ids),
        "cached_tokens": req.cached_tokens,
        "finish_reason": req.finish_reason,
        "e2e_latency": (req.finish_time or time.perf_counter()) - req.arrival_time,
    }
    if req.first_token_time is not None:
        meta["ttft"] = req.first_token_time - req.arrival_time
    if speculative:
        meta["spec_verify_ct"] = req.spec_verify_ct
        meta["spec_accept_length"] = len(req.output_ids) / max(req.spec_verify_ct, 1)
    rows = rows or _LogprobRows()
    if req.logprob_start_len >= 0:
        tokens, top = rows.update_input(req)
        meta["input_token_logprobs"] = tokens
        if req.top_logprobs_num:
            meta["input_top_logprobs"] = top
    if req.return_logprob:
        tokens, top = rows.update(req)
        meta["output_token_logprobs"] = tokens
        if req.top_logprobs_num:
            meta["output_top_logprobs"] = top
    return meta


def result(detok: Detokenizer, req: Request, *, speculative: bool) -> dict:
    return {"text": text(detok, req), "output_ids": list(req.output_ids),
            "meta_info": meta_info(req, speculative=speculative)}


class StreamChunks:
    """A streamed request's incremental dicts, one per signal of the engine loop (`put(final)` on
    the request's stream_queue), whose texts add up to the final text: a tail that may still grow
    into a stop string is held back (once the stop completes, the text is cut before it). Shared by
    the thread reader (`stream`) and the asyncio one (`astream`).

    The engine loop decodes a request's text only when it has stop strings to search; otherwise
    the reader decodes incrementally here, off the loop's critical path. detokenize=False: no text
    at all (every piece ""), for a caller that decodes the ids itself."""

    def __init__(self, detok: Detokenizer, req: Request, *, speculative: bool, detokenize: bool = True):
        self.detok, self.req, self.speculative, self.detokenize = detok, req, speculative, detokenize
        self.sent_ids = 0
        self.sent_text = ""
        self.rows = _LogprobRows()
        self.state = DetokState()  # the reader's own decoding, when the engine loop keeps none
        kept = req.sampling.no_stop_trim  # stops kept in the text need no holding back
        self.stops = [] if kept else list(req.sampling.stop or [])
        self.regexes = () if kept else req.sampling.stop_regex or ()

    def _text_now(self, upto: int) -> str:
        """The text that may be sent with the first `upto` output tokens in (not final)."""
        state = self.req.detok_state  # kept by the engine loop when it searches stop strings
        if state is None:
            state = self.state
            self.detok.step(state, self.req.output_ids[:upto], self.req.sampling.skip_special_tokens)
        return safe_prefix(state.text, self.stops, self.regexes, len(self.sent_text))

    def next(self, final: bool) -> dict | None:
        """The chunk for one signal: None when it brings nothing new (signals coalesce: a reader
        that fell behind finds every token at the first of them)."""
        req = self.req
        ids = req.output_ids[self.sent_ids:]
        if not self.detokenize:
            now = ""
        else:
            now = text(self.detok, req) if final else self._text_now(self.sent_ids + len(ids))
        piece = now[len(self.sent_text):]
        self.sent_ids += len(ids)
        self.sent_text = now
        if not (final or ids):
            return None
        meta = meta_info(req, speculative=self.speculative, rows=self.rows)
        if not final:  # the loop may finish it while this chunk is built: only the last one says so
            meta["finish_reason"] = None
        return {"text": piece, "output_ids": list(ids), "meta_info": meta}


def stream(detok: Detokenizer, req: Request, *, speculative: bool):
    """The chunks of a streamed request, read on the caller's thread (blocks between chunks)."""
    chunks = StreamChunks(detok, req, speculative=speculative)
    while True:
        final = req.stream_queue.get()
        chunk = chunks.next(final)
        if chunk is not None:
            yield chunk
        if final:
            return


_held = threading.local()  # the signals a thread holds back (`batched_signals`)


@contextlib.contextmanager
def batched_signals():
    """Hold back the `LoopSignal`s this thread puts inside the block, then hand them to their event
    loops at its end, one wake-up per loop (in the order they were put). The engine loop runs each
    step inside one: a step signals every streamed request, and a wake-up per request would let
    the event loop (which shares the GIL) interrupt the step at each."""
    if getattr(_held, "signals", None) is not None:  # nested: the outer block hands them over
        yield
        return
    _held.signals = []
    try:
        yield
    finally:
        signals, _held.signals = _held.signals, None
        by_loop: dict = {}
        for signal, final in signals:
            by_loop.setdefault(signal.loop, []).append((signal.queue, final))
        for loop, items in by_loop.items():
            _hand_over(loop, _put_all, items)


def _put_all(items: list) -> None:
    for queue, final in items:
        queue.put_nowait(final)


def _hand_over(loop: asyncio.AbstractEventLoop, fn, *args) -> None:
    try:
        loop.call_soon_threadsafe(fn, *args)
    except RuntimeError:  # the loop is closed: nobody reads this stream, and the engine loop goes on
        pass


class LoopSignal:
    """A stream_queue whose signals land in an asyncio queue of `loop`: the engine loop's thread
    hands each one straight to the event loop, with no reader thread between them (held back to the
    end of the step inside `batched_signals`)."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop = loop
        self.queue: asyncio.Queue[bool] = asyncio.Queue()

    def put(self, final: bool) -> None:
        held = getattr(_held, "signals", None)
        if held is not None:
            held.append((self, final))
        else:
            _hand_over(self.loop, self.queue.put_nowait, final)


async def astream(detok: Detokenizer, req: Request, *, speculative: bool, abort=None, detokenize: bool = True):
    """The chunks of a streamed request whose stream_queue is a `LoopSignal`, read on its loop.
    Left before its final chunk (closed, or its task cancelled), it calls abort(rid), so the
    request's pages and slot come back at the engine's next step."""
    chunks = StreamChunks(detok, req, speculative=speculative, detokenize=detokenize)
    final = False
    try:
        while not final:
            final = await req.stream_queue.queue.get()
            chunk = chunks.next(final)
            if chunk is not None:
                yield chunk
    finally:
        if not final and abort is not None:
            abort(req.rid)
