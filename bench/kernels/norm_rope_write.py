"""GPU check and timing of the fused q / k norm + rotary + KV write kernel
(`pallas_kernels/paged_attention/norm_rope_write.py`) against the XLA steps it replaces
(`reference.norm_rope_write`: slices, norms, rotary, scatter), at Qwen3-8B's heads (32 q, 8 KV,
D 128, bf16) and T tokens per step. For each T: the largest difference from the reference and the
fraction of differing elements (q, written K, written V), then microseconds per call of each, the
pages donated (updated in place) as in the engine's step.

    PYTHONPATH=. python3 bench/kernels/norm_rope_write.py --tokens 1,8,32,128,2048 --out OUT.json

Qwen3-Next's gated heads (16 q with gates, 2 KV, D 256, a quarter rotated, zero-centred norms):
`--heads 16 --kv-heads 2 --head-dim 256 --rotary-dim 64 --gated`.
"""

from __future__ import annotations

import argparse
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from jspec.bench.record import environment
from pallas_kernels import paged_attention as pa
from pallas_kernels.paged_attention import reference as ref


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default="1,8,32,128,2048")
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--rotary-dim", type=int, default=None, help="default: the head dim")
    ap.add_argument("--gated", action="store_true", help="q heads [query | gate], zero-centred norms (Qwen3-Next)")
    ap.add_argument("--pages", type=int, default=4096)
    ap.add_argument("--reps", type=int, default=50)
    ap.add_argument("--out")
    args = ap.parse_args(argv)
    h, g, d, page_size = args.heads, args.kv_heads, args.head_dim, 16
    rd = args.rotary_dim or d
    interpret = jax.default_backend() == "cpu"
    kw = dict(num_heads=h, eps=1e-6, zero_centred=args.gated, gated=args.gated)
    impls = {"xla": jax.jit(lambda *a: ref.norm_rope_write(*a, **kw), donate_argnums=(5, 6)),
             "kernel": jax.jit(lambda *a: pa.norm_rope_write(*a, **kw, interpret=interpret), donate_argnums=(5, 6))}
    rows = []
    for t in (int(v) for v in args.tokens.split(",")):
        rng = np.random.default_rng(t)
        qkv = jnp.asarray(rng.standard_normal((t, h * d * (2 if args.gated else 1) + 2 * g * d)), jnp.bfloat16)
        inv = 1.0 / (1e6 ** (np.arange(0, rd, 2) / rd))
        freqs = rng.integers(0, 8192, t)[:, None].astype(np.float32) * inv[None].astype(np.float32)
        cos, sin = jnp.asarray(np.cos(np.concatenate([freqs, freqs], -1))), jnp.asarray(np.sin(np.concatenate([freqs, freqs], -1)))
        q_w, k_w = (jnp.asarray(rng.standard_normal(d) * 0.1 + 1, jnp.bfloat16) for _ in range(2))
        slots = jnp.asarray(rng.permutation(args.pages * page_size)[:t], jnp.int32)
        shape = (args.pages, page_size, g, d)
        pages = lambda: (jnp.zeros(shape, jnp.bfloat16), jnp.zeros(shape, jnp.bfloat16))  # noqa: E731
        outs = {name: fn(qkv, cos, sin, q_w, k_w, *pages(), slots) for name, fn in impls.items()}
        row = {"tokens": t}
        for i, part in enumerate(("q", "k", "v", "k_pages", "v_pages")):
            a = np.asarray(outs["kernel"][i].astype(jnp.float32))
            b = np.asarray(outs["xla"][i].astype(jnp.float32))
            row[f"{part}_max_abs_diff"] = float(np.abs(a - b).max())
            row[f"{part}_frac_differing"] = float((a != b).mean())
        for name, fn in impls.items():
            k_pages, v_pages = pages()
            q, _, _, k_pages, v_pages = fn(qkv, cos, sin, q_w, k_w, k_pages, v_pages, slots)
            jax.block_until_ready(q)
            t0 = time.perf_counter()
            for _ in range(args.reps):
                q, _, _, k_pages, v_pages = fn(qkv, cos, sin, q_w, k_w, k_pages, v_pages, slots)
            jax.block_until_ready((q, k_pages))
            row[f"{name}_us"] = (time.perf_counter() - t0) / args.reps * 1e6
        print(json.dumps(row))
        rows.append(row)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"env": environment(), "heads": h, "kv_heads": g, "head_dim": d, "rotary_dim": rd,
                       "gated": args.gated, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
