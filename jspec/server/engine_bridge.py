"""The blocking `Engine` API bridged into asyncio, with client disconnects turned into aborts.

`Engine.generate` blocks until a request is done (or, streamed, blocks on each chunk) and may be
called from any number of threads at once; `Engine.abort` works from any thread. So each waiting
call gets its own thread (a thread pool of a fixed size would cap the requests in flight, which
is the scheduler's decision, not the server's), and the event loop only awaits futures and
queues. A request whose client goes away (or whose task is cancelled at shutdown) is aborted, so
the engine frees its pages and slot at its next step.

A streamed request is submitted from the event loop itself (`Engine.generate_stream_async` only
validates and queues), so a bad request is refused before any response header is sent; the
engine loop then wakes the event loop at each chunk, where a task per sub-request turns it into
text with `StreamText` and posts it to the request's queue (no thread between the engine loop and
the response, so a chunk waits for the GIL once, not twice).
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import uuid

from jspec.server.stream_text import StreamText


class ClientDisconnected(Exception):
    """The client closed the connection before its answer was ready (the request was aborted)."""


@dataclasses.dataclass
class StreamEvent:
    """One chunk of one sub-request (index) of a streamed HTTP request."""

    index: int
    ids: list[int]  # new token ids
    text: str  # new text (safe to send: see StreamText)
    meta: dict  # the engine's meta_info at this chunk (cumulative logprobs, counts)
    final: bool = False
    error: str | None = None


def new_rid() -> str:
    return uuid.uuid4().hex


def _settle(fut: asyncio.Future, ok: bool, value) -> None:
    if not fut.done():
        (fut.set_result if ok else fut.set_exception)(value)


async def wait_disconnect(request) -> None:
    """Return once the client has disconnected (the body was read already; what remains to
    receive on the connection is its end)."""
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


class EngineBridge:
    def __init__(self, engine, metrics=None):
        self.engine = engine
        self.metrics = metrics
        self.inflight = 0  # HTTP requests generating now
        self.draining = False  # set at SIGTERM: new generation requests get a 503

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def abort(self, rids) -> None:
        for rid in [rids] if isinstance(rids, str) else rids:
            self.engine.abort(rid)

    def _observe(self, out) -> None:
        if self.metrics is not None:
            for o in out if isinstance(out, list) else [out]:
                self.metrics.observe(o["meta_info"])

    # ------------------------------------------------------------------------- whole answers
    async def generate(self, request, *, rid, **kwargs):
        """`Engine.generate(rid=rid, **kwargs)` (not streamed: a dict, or a list for a batch) in a
        thread. request: the HTTP request, watched for a disconnect (None: not watched)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        # A result that arrives after the client left is never read: mark it retrieved.
        fut.add_done_callback(lambda f: f.cancelled() or f.exception())

        def work():
            try:
                out = self.engine.generate(rid=rid, stream=False, **kwargs)
                loop.call_soon_threadsafe(_settle, fut, True, out)
            except BaseException as e:  # noqa: BLE001 - handed to the awaiting request
                loop.call_soon_threadsafe(_settle, fut, False, e)

        self.inflight += 1
        watcher = asyncio.ensure_future(wait_disconnect(request)) if request is not None else None
        try:
            threading.Thread(target=work, name="jspec-http-generate", daemon=True).start()
            if watcher is not None:
                done, _ = await asyncio.wait({fut, watcher}, return_when=asyncio.FIRST_COMPLETED)
                if fut not in done:
                    self.abort(rid)
                    raise ClientDisconnected()
            out = await fut
        except asyncio.CancelledError:  # server shutdown past its grace period
            self.abort(rid)
            raise
        finally:
            self.inflight -= 1
            if watcher is not None:
                watcher.cancel()
        self._observe(out)
        return out

    # ------------------------------------------------------------------------- streams
    def open_streams(self, subs: list[dict]) -> Streams:
        """Submit each sub-request (`Engine.generate_stream_async` keywords); an invalid one
        raises `InvalidRequestError` here, after aborting those already submitted. Called on the
        event loop."""
        streams = Streams()
        try:
            for kw in subs:
                rid = kw.get("rid") or new_rid()
                # The server decodes the ids itself (StreamText), so the engine's chunks carry none.
                chunks = self.engine.generate_stream_async(**{**kw, "rid": rid}, detokenize=False)
                streams.rids.append(rid)
                sp = kw.get("sampling_params") or {}
                text = StreamText(self.tokenizer, stop=sp.get("stop"), stop_regex=sp.get("stop_regex"),
                                  no_stop_trim=sp.get("no_stop_trim", False),
                                  min_new_tokens=sp.get("min_new_tokens", 0),
                                  skip_special_tokens=sp.get("skip_special_tokens", True))
                streams.sources.append((chunks, text))
        except BaseException:
            self.abort(streams.rids)
            raise
        streams.tasks = [asyncio.ensure_future(streams.pump(index, chunks, text))
                         for index, (chunks, text) in enumerate(streams.sources)]
        return streams

    async def events(self, streams: Streams):
        """Every sub-request's events, as they come, until each has sent its final one. Leaving
        early (client gone, error, shutdown) aborts the sub-requests still running."""
        self.inflight += 1
        done: set[int] = set()
        try:
            while len(done) < len(streams.rids):
                ev = await streams.queue.get()
                if ev.final or ev.error is not None:
                    done.add(ev.index)
                    if ev.final and self.metrics is not None:
                        self.metrics.observe(ev.meta)
                yield ev
        finally:
            self.inflight -= 1
            self.abort([rid for i, rid in enumerate(streams.rids) if i not in done])
            for task in streams.tasks:
                task.cancel()


class Streams:
    """The engine streams of one HTTP request, merged into one asyncio queue."""

    def __init__(self):
        self.queue: asyncio.Queue[StreamEvent] = asyncio.Queue()
        self.rids: list[str] = []
        self.sources: list[tuple] = []
        self.tasks: list[asyncio.Future] = []

    async def pump(self, index: int, chunks, text: StreamText) -> None:
        """Task body: read one engine stream to its end, posting an event per chunk.

        The final event is the chunk whose meta_info has a finish_reason and counts every token
        received: a chunk read while the engine finishes may show the finish_reason before the
        last token is in its ids, and then one more chunk follows."""
        meta: dict = {}
        post = self.queue.put_nowait
        try:
            async for chunk in chunks:
                meta = chunk["meta_info"]
                text.add(chunk["output_ids"])
                final = meta.get("finish_reason") is not None and meta.get("completion_tokens") == len(text.ids)
                piece = text.delta() + (text.finish(meta.get("finish_reason")) if final else "")
                post(StreamEvent(index, list(chunk["output_ids"]), piece, meta, final=final))
                if final:
                    return
            post(StreamEvent(index, [], text.finish(meta.get("finish_reason")), meta, final=True))
        except Exception as e:  # noqa: BLE001 - this request fails; the server and the others go on
            post(StreamEvent(index, [], "", meta, error=f"{type(e).__name__}: {e}"))
