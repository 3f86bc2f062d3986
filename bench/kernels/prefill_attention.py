"""GPU check and timing of the two-part prompt-chunk attention (`pallas_kernels/paged_attention/
prefill.py`: cuDNN over each request's own tokens, the kernel over its cached prefix) against the
kernel alone (`paged_attention`, causal) and cuDNN's dense causal attention where one exists.

Correctness: largest difference from the reference's causal ragged attention (float32 oracle) on
ragged chunks with and without prefixes. Rates: TFLOP/s of the causal work per case
(bucket tokens T, requests B of the bucket, each request's new tokens and cached prefix); for a
lone request also cuDNN's part alone with the bucket's B segments and with 4 and 2 (what the
segments cost).

    PYTHONPATH=. python3 bench/kernels/prefill_attention.py --out OUT.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.record import environment
from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import reference as ref
from pallas_kernels.paged_attention.prefill import own_part_cudnn

PAGE = 16
HEADS = {"qwen3-8b": (32, 8, 128), "qwen3-next": (16, 2, 256)}
# (heads, bucket tokens, bucket requests, [(new tokens, cached prefix) per request])
CASES = [
    ("qwen3-8b", 8192, 64, [(8192, 0)]),
    ("qwen3-8b", 8192, 64, [(5000, 0)]),
    ("qwen3-8b", 8192, 64, [(8192, 8192)]),
    ("qwen3-8b", 8192, 64, [(2048, 0)] * 4),
    ("qwen3-8b", 4096, 64, [(4096, 0)]),
    ("qwen3-8b", 2048, 64, [(2048, 6144)]),
    ("qwen3-8b", 2048, 64, [(2048, 0)]),
    ("qwen3-8b", 1024, 64, [(1024, 0)]),
    ("qwen3-next", 8192, 64, [(8192, 0)]),
    ("qwen3-next", 8192, 64, [(8192, 8192)]),
]
# one request with and without a prefix (two parts), several requests (the kernel alone)
CHECKS = [("qwen3-8b", 1024, 8, [(900, 300)]), ("qwen3-8b", 2048, 64, [(1500, 0)]),
          ("qwen3-8b", 1024, 8, [(300, 0), (200, 77), (400, 1000)]), ("qwen3-next", 512, 4, [(400, 33)])]


def build(rng, heads, tokens, batch, reqs, dtype=jnp.bfloat16):
    h, g, d = heads
    pages_per_seq = max(-(-(n + p) // PAGE) for n, p in reqs)
    num_pages = len(reqs) * pages_per_seq + 1
    k = jnp.asarray(rng.standard_normal((num_pages, PAGE, g, d)), dtype)
    v = jnp.asarray(rng.standard_normal((num_pages, PAGE, g, d)), dtype)
    table = np.zeros((batch, pages_per_seq), np.int32)
    table[:len(reqs)] = 1 + np.arange(len(reqs) * pages_per_seq).reshape(len(reqs), pages_per_seq)
    q_lens = [n for n, _ in reqs] + [0] * (batch - len(reqs))
    seq = np.asarray([n + p for n, p in reqs] + [0] * (batch - len(reqs)), np.int32)
    cu = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    slots = np.full(tokens, -1, np.int32)
    for b, (n, p) in enumerate(reqs):
        pos = p + np.arange(n)
        slots[cu[b]:cu[b] + n] = table[b, pos // PAGE] * PAGE + pos % PAGE
    q = jnp.asarray(rng.standard_normal((tokens, h, d)), dtype)
    own = tuple(x.reshape(-1, g, d)[jnp.maximum(jnp.asarray(slots), 0)] for x in (k, v))  # the chunk's k / v
    flops = sum(4 * h * d * n * (p + (n + 1) / 2) for n, p in reqs)
    return (q, k, v, jnp.asarray(table), jnp.asarray(seq), jnp.asarray(cu)), own, flops


def timeit(fn, args, reps=10):
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    for _ in range(reps):
        out = fn(*args)
    jax.block_until_ready(out)
    return (time.perf_counter() - t0) / reps


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    res = {"env": environment(), "checks": [], "rates": []}
    rng = np.random.default_rng(0)
    for name, tokens, batch, reqs in CHECKS:
        heads = HEADS[name]
        a, own, _ = build(rng, heads, tokens, batch, reqs)
        scale = 1 / math.sqrt(heads[2])
        want = np.asarray(jax.jit(lambda *x: ref.paged_attention(*x, sm_scale=scale))(
            *(x.astype(jnp.float32) if x.dtype == jnp.bfloat16 else x for x in a)))
        row = {"heads": name, "T": tokens, "B": batch, "reqs": reqs}
        for impl, fn in (("two_part", lambda *x: pa.prefill_attention(x[0], *own, *x[1:], sm_scale=scale)),
                         ("kernel", lambda *x: pa.paged_attention(*x, sm_scale=scale))):
            got = np.asarray(jax.jit(fn)(*a).astype(jnp.float32))
            row[f"{impl}_max_abs_err"] = float(np.abs(got - want).max())
        res["checks"].append(row)
        print(json.dumps(row))
    for name, tokens, batch, reqs in CASES:
        heads = HEADS[name]
        a, own, flops = build(rng, heads, tokens, batch, reqs)
        scale = 1 / math.sqrt(heads[2])
        row = {"heads": name, "T": tokens, "B": batch, "reqs": reqs, "gflop": flops / 1e9}
        impls = {"two_part": jax.jit(lambda *x: pa.prefill_attention(x[0], x[6], x[7], *x[1:6], sm_scale=scale)),
                 "kernel": jax.jit(lambda *x: pa.paged_attention(*x[:6], sm_scale=scale))}
        if len(reqs) == 1 and reqs[0][1] == 0 and reqs[0][0] == tokens:  # cuDNN alone, dense causal
            kd, vd = own
            impls["cudnn_dense"] = jax.jit(lambda *x: jax.nn.dot_product_attention(
                x[0][None], kd[None], vd[None], scale=scale, is_causal=True, implementation="cudnn"))
        for impl, fn in impls.items():
            try:
                s = timeit(fn, a + own)
                row[f"{impl}_ms"], row[f"{impl}_tflops"] = s * 1e3, flops / s / 1e12
            except Exception as e:  # noqa: BLE001
                row[f"{impl}_error"] = repr(e)[:400]
        if len(reqs) == 1:  # cuDNN's part alone, with the bucket's B segments and with fewer
            for segs in sorted({batch, 4, 2}):
                cu = a[5][:segs + 1]
                try:
                    s = timeit(jax.jit(lambda q, k, v, cu: own_part_cudnn(q, k, v, cu, sm_scale=scale, segments=segs)),
                               (a[0], *own, cu))
                    row[f"own_part_{segs}_segments_ms"] = s * 1e3
                except Exception as e:  # noqa: BLE001
                    row[f"own_part_{segs}_segments_error"] = repr(e)[:400]
        res["rates"].append(row)
        print(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in row.items()}))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
