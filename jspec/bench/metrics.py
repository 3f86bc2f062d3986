"""Summary of one run, with SGLang `bench_serving`'s metric names (milliseconds for latencies).

TPOT per request is (latency - ttft) / (output_len - 1); ITL pools every chunk gap of every
request; concurrency is the sum of request latencies over the duration (average in flight).
"""

from __future__ import annotations

import numpy as np

from jspec.bench.client import RequestResult

LATENCIES = ("ttft", "tpot", "itl", "e2e_latency")
STATS = ("mean", "median", "std", "p95", "p99", "max")


def _stats(name: str, seconds: list[float]) -> dict:
    # An empty list (e.g. no ITL when every request made one token) gives nulls, not zeros:
    # a zero latency would read as a measurement.
    if not seconds:
        return {f"{s}_{name}_ms": None for s in STATS}
    x = np.asarray(seconds, dtype=np.float64) * 1000.0
    return {f"mean_{name}_ms": float(x.mean()), f"median_{name}_ms": float(np.median(x)),
            f"std_{name}_ms": float(x.std()), f"p95_{name}_ms": float(np.percentile(x, 95)),
            f"p99_{name}_ms": float(np.percentile(x, 99)), f"max_{name}_ms": float(x.max())}


def peak_output_throughput(token_times: list[float], duration: float) -> float:
    """Most tokens received in any window of 1 s (of the whole run when it is shorter), per second.

    A sliding window starting at each token, where vLLM / SGLang bin by whole seconds from the
    start: bins split bursts arbitrarily, and sub-second CPU runs would have only one bin.
    """
    if not token_times:
        return 0.0
    t = np.sort(np.asarray(token_times))
    window = min(1.0, max(duration, 1e-9))
    ends = np.searchsorted(t, t + window, side="left")
    return float((ends - np.arange(len(t))).max() / window)


def accept_length(result: RequestResult) -> float:
    """Tokens per verify pass; 1.0 without speculation (one token per decode step)."""
    if result.spec_verify_ct:
        return result.output_len / result.spec_verify_ct
    return 1.0


def summarize(results: list[RequestResult], duration: float) -> dict:
    ok = [r for r in results if r.success]
    total_in = sum(r.prompt_len for r in ok)
    total_out = sum(r.output_len for r in ok)
    verify = sum(r.spec_verify_ct or 0 for r in ok)
    dur = max(duration, 1e-9)
    m = {
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration_s": duration,
        "total_input_tokens": total_in,
        "total_output_tokens": total_out,
        "request_throughput": len(ok) / dur,
        "input_throughput": total_in / dur,
        "output_throughput": total_out / dur,
        "total_throughput": (total_in + total_out) / dur,
        "peak_output_throughput": peak_output_throughput([t for r in ok for t in r.token_times], duration),
        "concurrency": sum(r.latency for r in ok) / dur,
        # Over the whole run, as SGLang's avg_spec_accept_length: total tokens / total verify passes.
        "accept_length": total_out / verify if verify else 1.0,
        "spec_verify_ct": verify or None,
        # Prompt tokens the prefix cache served during the run (engine-wide hit rates include warm-up).
        "cache_hit_rate": sum(r.cached_tokens for r in ok) / total_in if total_in else 0.0,
    }
    m.update(_stats("ttft", [r.ttft for r in ok]))
    m.update(_stats("tpot", [(r.latency - r.ttft) / (r.output_len - 1) for r in ok if r.output_len > 1]))
    m.update(_stats("itl", [g for r in ok for g in r.itl]))
    m.update(_stats("e2e_latency", [r.latency for r in ok]))
    return m
