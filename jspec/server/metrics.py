"""Prometheus metrics of the server (`GET /metrics`), named after SGLang's with a `jspec:` prefix.

Counted by the server as requests finish (from the engine's meta_info, so a streamed and a
non-streamed request count alike): requests by endpoint and status, prompt / generated / cached
tokens, TTFT, TPOT and end-to-end latency histograms. Read from `Engine.get_server_info()` at
scrape time, so they are never stale: running and waiting requests, pages in use, the prefix
cache hit rate, retractions, and the speculative accept-length histogram (tokens per verify step,
as the engine counts them). Each server owns its registry, so two in one process do not collide.
Also the process's garbage-collector pauses by generation (a full collection stops the engine
loop and the event loop alike; every `Engine` freezes what its start-up allocated to keep them
short, `jspec.runtime.gc_heap`).
"""

from __future__ import annotations

import gc
import threading
import time

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

PREFIX = "jspec:"
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.03, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0)
E2E_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
ACCEPT_BUCKETS = 16  # accept-length buckets 1..16 tokens per verify step (longer ones land in +Inf)


class EngineCollector:
    """Gauges and the accept-length histogram, read from the engine at each scrape."""

    def __init__(self, engine):
        self.engine = engine

    def collect(self):
        info = self.engine.get_server_info()
        total, free = info["num_total_pages"], info["num_free_pages"]
        gauges = {
            "num_running_reqs": ("requests running (holding a slot)", info["num_running_requests"]),
            "num_queue_reqs": ("requests waiting to be admitted", info["num_waiting_requests"]),
            "num_used_pages": ("KV pages in use (running requests and cached prefixes)", total - free),
            "num_total_pages": ("KV pages in the pool", total),
            "token_usage": ("fraction of the KV pool in use", (total - free) / max(total, 1)),
            "cache_hit_rate": ("prefix cache hit rate (prompt tokens served from cache)",
                               info.get("cache_hit_rate", 0.0) or 0.0),
        }
        for name, (doc, value) in gauges.items():
            yield GaugeMetricFamily(PREFIX + name, doc, value=float(value))
        retractions = CounterMetricFamily(PREFIX + "num_retractions", "requests pushed back to the queue for pages")
        retractions.add_metric([], float(info["num_retractions"]))
        yield retractions
        hist = info.get("spec_accept_length_histogram")
        if hist is not None:
            yield self._accept_histogram({int(k): int(v) for k, v in hist.items()})

    @staticmethod
    def _accept_histogram(hist: dict[int, int]) -> HistogramMetricFamily:
        buckets, running = [], 0
        for le in range(1, ACCEPT_BUCKETS + 1):
            running += sum(v for k, v in hist.items() if le - 1 < k <= le)
            buckets.append((str(float(le)), running))
        buckets.append(("+Inf", sum(hist.values())))
        return HistogramMetricFamily(PREFIX + "spec_accept_length", "tokens accepted per speculative verify step",
                                     buckets=buckets, sum_value=float(sum(k * v for k, v in hist.items())))


class GcPauses:
    """Collector of the process's garbage-collection pauses (`gc.callbacks`, installed once per
    process): count, total and longest seconds per generation."""

    _lock = threading.Lock()
    _stats: dict[int, list[float]] = {}  # generation -> [count, seconds, longest]
    _started: dict[int, float] = {}  # thread id -> start of the collection it runs
    _installed = False

    @classmethod
    def install(cls) -> "GcPauses":
        with cls._lock:
            if not cls._installed:
                gc.callbacks.append(cls._callback)
                cls._installed = True
        return cls()

    @classmethod
    def _callback(cls, phase: str, info: dict) -> None:
        now, me = time.perf_counter(), threading.get_ident()
        if phase == "start":
            cls._started[me] = now
            return
        began = cls._started.pop(me, None)
        if began is not None:
            row = cls._stats.setdefault(info["generation"], [0, 0.0, 0.0])
            row[0] += 1
            row[1] += now - began
            row[2] = max(row[2], now - began)

    def collect(self):
        stats = {g: list(v) for g, v in sorted(self._stats.items())}
        count = CounterMetricFamily(PREFIX + "gc_pauses", "garbage collections", labels=["generation"])
        total = CounterMetricFamily(PREFIX + "gc_pause_seconds", "seconds spent in garbage collections",
                                    labels=["generation"])
        longest = GaugeMetricFamily(PREFIX + "gc_pause_max_seconds", "the longest garbage collection",
                                    labels=["generation"])
        for g, (n, seconds, most) in stats.items():
            count.add_metric([str(g)], n)
            total.add_metric([str(g)], seconds)
            longest.add_metric([str(g)], most)
        yield from (count, total, longest)


class ServerMetrics:
    def __init__(self, engine):
        r = self.registry = CollectorRegistry()
        self.requests = Counter(PREFIX + "num_requests", "HTTP requests answered", ["endpoint", "status"], registry=r)
        self.prompt_tokens = Counter(PREFIX + "prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.generation_tokens = Counter(PREFIX + "generation_tokens", "tokens generated by finished requests",
                                         registry=r)
        self.cached_tokens = Counter(PREFIX + "cached_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.ttft = Histogram(PREFIX + "time_to_first_token_seconds", "arrival to first token", registry=r,
                              buckets=TTFT_BUCKETS)
        self.tpot = Histogram(PREFIX + "time_per_output_token_seconds",
                              "per request: (latency - ttft) / (output tokens - 1)", registry=r, buckets=TPOT_BUCKETS)
        self.e2e = Histogram(PREFIX + "e2e_request_latency_seconds", "arrival to last token", registry=r,
                             buckets=E2E_BUCKETS)
        r.register(EngineCollector(engine))
        r.register(GcPauses.install())

    def observe(self, meta: dict) -> None:
        """One finished engine request (its meta_info)."""
        n = int(meta.get("completion_tokens", 0))
        self.prompt_tokens.inc(int(meta.get("prompt_tokens", 0)))
        self.generation_tokens.inc(n)
        self.cached_tokens.inc(int(meta.get("cached_tokens", 0)))
        e2e, ttft = meta.get("e2e_latency"), meta.get("ttft")
        if e2e is not None:
            self.e2e.observe(e2e)
        if ttft is not None:
            self.ttft.observe(ttft)
            if n > 1 and e2e is not None:
                self.tpot.observe((e2e - ttft) / (n - 1))


class RequestCounter:
    """ASGI middleware: counts every HTTP request by route (its template, so ids in paths do not
    make new series; "unmatched" for unknown paths) and response status (500 when it raised)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        status = [500]

        async def send_status(message):
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_status)
        finally:
            route = scope.get("route")
            endpoint = getattr(route, "path", None) or "unmatched"
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
