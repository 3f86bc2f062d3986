"""Send a workload to an in-process Engine and time every request from the caller's side.

Each in-flight request streams (a task on one event loop for an in-process Engine, a thread per
request for the HTTP client): the time a chunk of tokens reaches the caller is what a user sees, so TTFT, ITL and E2E latency are taken here, as SGLang's
`bench_serving` takes them at its HTTP client (ITL is one gap per streamed chunk, as there).
"""

from __future__ import annotations

import asyncio
import dataclasses
import math
import threading
import time

import numpy as np

from jspec.bench.datasets import BenchRequest, Conversation


@dataclasses.dataclass
class RequestResult:
    prompt_len: int
    output_len: int = 0  # tokens generated, as the engine counted them (completion_tokens)
    success: bool = False
    error: str = ""
    ttft: float = 0.0  # seconds from submission to the first streamed token
    latency: float = 0.0  # seconds from submission to the final chunk
    itl: list[float] = dataclasses.field(default_factory=list)  # gaps between chunks after the first
    token_times: list[float] = dataclasses.field(default_factory=list)  # perf_counter per token received
    spec_verify_ct: int | None = None  # verify passes, when the engine speculates
    finish_reason: object = None
    cached_tokens: int = 0  # prompt tokens the prefix cache served


# Engine.generate keywords (and /generate's top-level fields), not sampling params.
GENERATE_KEYS = ("return_logprob", "top_logprobs_num", "logprob_start_len")


class _Recorder:
    """One request's result, filled chunk by chunk as the caller receives them."""

    def __init__(self, req: BenchRequest):
        self.res = RequestResult(prompt_len=len(req.input_ids))
        self.output_ids: list[int] = []
        self.meta: dict = {}
        self.start = self.last = time.perf_counter()

    def chunk(self, chunk: dict) -> None:
        now = time.perf_counter()
        res, k = self.res, len(chunk["output_ids"])
        self.output_ids.extend(chunk["output_ids"])
        if k:
            if not res.token_times:
                res.ttft = now - self.start
            else:
                res.itl.append(now - self.last)
            self.last = now
            res.token_times.extend([now] * k)
        self.meta = chunk["meta_info"]

    def end(self) -> None:
        res, meta = self.res, self.meta
        res.latency = time.perf_counter() - self.start
        res.output_len = int(meta.get("completion_tokens", len(res.token_times)))
        res.finish_reason = meta.get("finish_reason")
        res.cached_tokens = int(meta.get("cached_tokens", 0))
        if meta.get("spec_verify_ct") is not None:
            res.spec_verify_ct = int(meta["spec_verify_ct"])
        reason = res.finish_reason or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            res.error = f"aborted: {reason.get('message')}"
        elif res.output_len != len(res.token_times):
            # The stream and the engine's count must agree, or every token metric is off.
            res.error = f"streamed {len(res.token_times)} tokens but the engine reports {res.output_len}"
        else:
            res.success = True


def _request_args(req: BenchRequest, sampling: dict) -> dict:
    # The generate keywords ride in the sampling dict (`serve.sampling_params`).
    extra = {k: sampling[k] for k in GENERATE_KEYS if k in sampling}
    params = {k: v for k, v in sampling.items() if k not in GENERATE_KEYS}
    return dict(input_ids=req.input_ids, sampling_params={**params, "max_new_tokens": req.output_len}, **extra)


def _run_one(engine, req: BenchRequest, sampling: dict, results: list, idx: int, sem) -> list[int]:
    """Stream one request into results[idx] (on this thread); returns the token ids it generated."""
    rec = _Recorder(req)
    try:
        for chunk in engine.generate(stream=True, **_request_args(req, sampling)):
            rec.chunk(chunk)
        rec.end()
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not the end of the run
        rec.res.error = f"{type(e).__name__}: {e}"
    finally:
        results[idx] = rec.res
        if sem is not None:
            sem.release()
    return rec.output_ids


async def _run_one_async(engine, req: BenchRequest, sampling: dict, results: list, idx: int) -> None:
    """`_run_one` on the event loop, through `Engine.generate_stream_async`."""
    rec = _Recorder(req)
    try:
        async for chunk in engine.generate_stream_async(**_request_args(req, sampling)):
            rec.chunk(chunk)
        rec.end()
    except Exception as e:  # noqa: BLE001 - a failed request is a result, not the end of the run
        rec.res.error = f"{type(e).__name__}: {e}"
    finally:
        results[idx] = rec.res


def arrival_offsets(n: int, request_rate: float, seed: int) -> np.ndarray:
    """Seconds after the start at which each request is sent: all at t=0 for an infinite rate,
    else a Poisson process (exponential gaps, seeded), the first request at t=0 as in SGLang."""
    if math.isinf(request_rate):
        return np.zeros(n)
    gaps = np.random.default_rng(seed).exponential(1.0 / request_rate, size=n)
    return np.concatenate([[0.0], np.cumsum(gaps[:-1])])


def run_requests(engine, requests: list[BenchRequest], sampling: dict, request_rate: float = math.inf,
                 max_concurrency: int | None = None, seed: int = 0) -> tuple[list[RequestResult], float]:
    """Send every request (arrivals per `request_rate`, at most `max_concurrency` in flight) and
    wait for all; returns the per-request results (in request order) and the duration in seconds.

    An in-process Engine is driven from an event loop (`generate_stream_async`: the engine loop
    hands each chunk to it directly, as `jspec serve` does); a client without it (the HTTP one)
    gets a thread per request."""
    results: list = [None] * len(requests)
    offsets = arrival_offsets(len(requests), request_rate, seed)
    if hasattr(engine, "generate_stream_async"):
        return asyncio.run(_run_requests_async(engine, requests, sampling, offsets, max_concurrency, results))
    # The semaphore is taken before a request's thread starts, so a capped run holds at most
    # `max_concurrency` threads and a late request starts as soon as a slot frees, as in SGLang.
    sem = threading.Semaphore(max_concurrency) if max_concurrency else None
    start = time.perf_counter()
    _threads_at(offsets, sem, "bench-req", lambda i: (_run_one, (engine, requests[i], sampling, results, i, sem)))
    return results, time.perf_counter() - start


def _threads_at(offsets, sem, name: str, work) -> None:
    """Start thread i (its target and arguments: work(i)) offsets[i] seconds from now, once it has
    taken sem (None: no cap), and wait for all of them."""
    threads = []
    start = time.perf_counter()
    for i in range(len(offsets)):
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if sem is not None:
            sem.acquire()
        target, args = work(i)
        t = threading.Thread(target=target, args=args, name=f"{name}-{i}", daemon=True)
        t.start()
        threads.append(t)
    for t in threads:
        t.join()


async def _run_requests_async(engine, requests, sampling, offsets, max_concurrency, results):
    sem = asyncio.Semaphore(max_concurrency or len(requests) or 1)

    async def one(i: int) -> None:
        try:
            await _run_one_async(engine, requests[i], sampling, results, i)
        finally:
            sem.release()

    tasks = []
    start = time.perf_counter()
    for i in range(len(requests)):
        delay = start + offsets[i] - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        await sem.acquire()  # taken before the request starts, as the threaded path does
        tasks.append(asyncio.ensure_future(one(i)))
    await asyncio.gather(*tasks)
    return results, time.perf_counter() - start


def run_conversations(engine, conversations: list[Conversation], sampling: dict, request_rate: float = math.inf,
                      max_concurrency: int | None = None, seed: int = 0) -> tuple[list[RequestResult], float]:
    """Multi-turn chats: conversations start per `request_rate` (at most `max_concurrency` at a
    time), each sends its turns one after another, a turn's prompt being the chat so far (earlier
    user tokens and the tokens generated for them) plus its own. Returns one result per turn (turns
    of a conversation together, conversations in order) and the duration in seconds."""
    firsts = [0]
    for c in conversations:
        firsts.append(firsts[-1] + len(c.turns))
    results: list = [None] * firsts[-1]
    offsets = arrival_offsets(len(conversations), request_rate, seed)
    sem = threading.Semaphore(max_concurrency) if max_concurrency else None

    def chat(ci: int) -> None:
        history: list[int] = []
        try:
            for k, turn in enumerate(conversations[ci].turns):
                req = BenchRequest(history + turn.input_ids, turn.output_len)
                history = req.input_ids + _run_one(engine, req, sampling, results, firsts[ci] + k, None)
                if not results[firsts[ci] + k].success:
                    break  # the rest of the chat has no reply to build on: its turns stay failed
        finally:
            for k in range(len(conversations[ci].turns)):
                if results[firsts[ci] + k] is None:
                    results[firsts[ci] + k] = RequestResult(prompt_len=0, error="an earlier turn failed")
            if sem is not None:
                sem.release()

    start = time.perf_counter()
    _threads_at(offsets, sem, "bench-chat", lambda i: (chat, (i,)))
    return results, time.perf_counter() - start
