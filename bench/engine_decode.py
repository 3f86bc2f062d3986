"""Engine decode benchmark: ms per decode step vs the weight + KV bytes / copy-bandwidth floor.

For each model shape (random bf16 weights) and each (batch, context):
- the compiled decode step of the engine's ModelRunner is called repeatedly on a batch whose
  requests each hold `context` tokens of random KV (never zeros), and its median time is compared
  with `bytes moved / copy bandwidth`, the copy measured in this same run;
- start-up compile time of the decode buckets, cold (empty persistent cache), warm (a second
  build reading XLA's persistent cache) and warm with jspec's compiled-step cache (a build that
  loads the executables a third one stored: no tracing);
- an end-to-end `Engine.generate` at batch 1 (host loop included) and HF transformers' greedy
  `generate` on the same weights, as the peer.

Usage: python bench/engine_decode.py --out results.json [--models qwen3-8b,qwen3-next-12l] [--budget-s 500]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", "0.72")

import numpy as np  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from jspec.cache.pool import PoolLayout  # noqa: E402
from jspec.config import parse_hf_config  # noqa: E402
from jspec.models.loader import random_model  # noqa: E402
from jspec.models.presets import preset_config  # noqa: E402
from jspec.bench.step import copy_bandwidth, roofline  # noqa: E402
from jspec.runtime.executable_cache import ExecutableCache  # noqa: E402
from jspec.runtime.model_runner import ModelRunner  # noqa: E402

T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:7.1f}s]", *a, flush=True)


def commit() -> str:
    """The commit measured: $JSPEC_COMMIT (set by whoever copied the tree to a machine without
    .git), else git's HEAD."""
    if os.environ.get("JSPEC_COMMIT"):
        return os.environ["JSPEC_COMMIT"]
    try:
        return subprocess.check_output(["git", "rev-parse", "HEAD"], text=True).strip()
    except Exception:  # noqa: BLE001
        return "unknown"


def bench_model(preset, grid, copy_bps, results, budget_end, cache_dir):
    cfg = parse_hf_config(preset_config(preset))
    log(f"{preset}: building random bf16 weights")
    model = random_model(cfg, dtype="bfloat16", seed=0, scale=0.02)
    jax.block_until_ready(jax.tree_util.tree_leaves(model.params))
    log(f"{preset}: {model.num_parameters() / 1e9:.2f} B params, {model.num_bytes() / 2**30:.1f} GiB")
    page_size = 16
    max_b = max(b for b, _ in grid)
    max_ctx = max(c for _, c in grid)
    need_pages = max(b * -(-c // page_size) for b, c in grid) + 1
    pages_per_seq = -(-max_ctx // page_size)
    decode_bs = sorted({b for b, _ in grid})
    entry = {"preset": preset, "num_parameters": model.num_parameters(), "param_bytes": model.num_bytes(),
             "page_size": page_size, "points": []}
    results["models"].append(entry)

    jax.config.update("jax_compilation_cache_dir", cache_dir)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0)
    # The roofline (timing, bytes, floor) is `jspec bench step`'s; it compiles the decode buckets cold.
    records = roofline(model, grid, copy_bps=copy_bps, page_size=page_size)
    entry["compile_cold_s"] = records[0]["compile_s"]
    entry["points"] = records
    log(f"{preset}: compiled decode buckets cold in {entry['compile_cold_s']:.1f}s")
    for r in records:
        log(f"{preset}: B={r['batch']:4d} ctx={r['context']:5d}  {r['ms_per_step']:7.3f} ms/step  "
            f"floor {r['floor_ms']:6.3f} ms  -> {r['fraction_of_copy_bandwidth']:.2f} of floor")

    # Warm start: a second runner over the same buckets reads the persistent compilation cache.
    if time.perf_counter() < budget_end:
        layout = PoolLayout(page_size=page_size, num_pages=need_pages, num_slots=max_b + 1,
                            pages_per_seq=pages_per_seq)
        r2 = ModelRunner(model, layout=layout, decode_batch_sizes=decode_bs, extend_token_sizes=[],
                         max_extend_requests=1, progress=False)
        entry["compile_warm_s"] = r2.compile_seconds
        log(f"{preset}: warm compile {r2.compile_seconds:.1f}s")
        del r2
        # And with jspec's compiled-step cache: the first runner stores, the second loads (no tracing).
        exes = ExecutableCache(os.path.join(cache_dir, "executables"), context=f"engine_decode {preset}")
        for name in ("compile_store_executables_s", "compile_warm_executables_s"):
            r3 = ModelRunner(model, layout=layout, decode_batch_sizes=decode_bs, extend_token_sizes=[],
                             max_extend_requests=1, progress=False, executables=exes)
            entry[name] = r3.compile_seconds
            del r3
        log(f"{preset}: warm start with the compiled-step cache {entry['compile_warm_executables_s']:.1f}s "
            f"({exes.hits} loads)")
    return model


def engine_e2e(model, results, n_new=128):
    """Engine.generate at batch 1 (host loop, sampling, detokenizer-free) vs its decode step."""
    from jspec.api import Engine

    eng = Engine(model, page_size=16, cuda_graph_bs=[1], max_running_requests=1, chunked_prefill_size=512,
                 prefill_token_buckets=[512], context_length=2048, max_total_tokens=4096, show_progress=False)
    try:
        sp = {"max_new_tokens": n_new, "temperature": 0, "ignore_eos": True}
        v = model.config.vocab_size
        eng.generate(input_ids=[(10 + i) % v for i in range(512)], sampling_params=sp)  # warm
        out = eng.generate(input_ids=[(20 + i) % v for i in range(512)], sampling_params=sp)
        m = out["meta_info"]
        decode_s = m["e2e_latency"] - m["ttft"]
        res = {"prompt_tokens": 512, "new_tokens": n_new, "ttft_s": m["ttft"], "e2e_s": m["e2e_latency"],
               "decode_tok_per_s": (n_new - 1) / decode_s, "ms_per_token": decode_s / (n_new - 1) * 1e3,
               "compile_s": eng.runner.compile_seconds}
    finally:
        eng.shutdown()
    results["engine_e2e_batch1"] = res
    log(f"engine e2e batch 1: {res['decode_tok_per_s']:.1f} tok/s ({res['ms_per_token']:.3f} ms/token)")


def hf_peer(model, preset, results, n_new=64):
    """HF transformers greedy generate on the same weights (eager and static cache), batch 1."""
    import torch
    import transformers

    from jspec.models.loader import state_to_flat

    DEV = "cuda" if torch.cuda.is_available() else "cpu"

    cfg_dict = preset_config(preset)
    cfg_dict.pop("architectures")
    mt = cfg_dict.pop("model_type")
    hf_cfg = transformers.AutoConfig.for_model(mt, **cfg_dict)
    with torch.device(DEV):  # random init on the device is fast; the weights are replaced below
        hf = transformers.AutoModelForCausalLM.from_config(hf_cfg, torch_dtype=torch.bfloat16)
    sd = {}
    for k, v in state_to_flat(model.params).items():  # host copies; load_state_dict moves them
        sd[k] = torch.from_numpy(np.asarray(v).view(np.int16)).view(torch.bfloat16)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    hf = hf.eval()
    ids = (torch.arange(20, 532, device=DEV) % model.config.vocab_size)[None]
    out = {"missing_keys": len(missing), "unexpected_keys": len(unexpected)}
    for mode in ("dynamic", "static"):
        kw = dict(max_new_tokens=n_new, min_new_tokens=n_new, do_sample=False, pad_token_id=0)
        if mode == "static":
            kw["cache_implementation"] = "static"
        try:
            hf.generate(ids, **dict(kw, max_new_tokens=4, min_new_tokens=4))
            sync = torch.cuda.synchronize if DEV == "cuda" else (lambda: None)
            sync()
            t = time.perf_counter()
            hf.generate(ids, **kw)
            sync()
            sec = time.perf_counter() - t
            out[mode] = {"tok_per_s": n_new / sec, "ms_per_token": sec / n_new * 1e3}
            log(f"HF transformers ({mode} cache) batch 1: {n_new / sec:.1f} tok/s")
        except Exception as e:  # noqa: BLE001
            out[mode] = {"error": repr(e)[:300]}
    results["hf_peer_batch1"] = out
    del hf, sd
    if DEV == "cuda":
        torch.cuda.empty_cache()


def sampler_bench(results):
    """The sampler alone at V = 151936: greedy rows (the lax.cond skips the sort) vs rows that need
    the sort, to see what the sort and the conditional cost on this device; and greedy rows with
    the logit bias every engine step applies (MAX_LOGIT_BIAS entries a row: all unused, as for
    requests without one, or all used) against the same rows without it."""
    from jspec.runtime import sampler as smp
    from jspec.runtime.sampling_params import MAX_LOGIT_BIAS

    v = 151936
    out = {}
    for b in (1, 32, 128):
        logits = jax.random.normal(jax.random.PRNGKey(b), (b, v), jnp.float32)
        counts = jnp.zeros((b, v), jnp.int32)
        mask = jnp.zeros((b, v), bool)
        used = jax.random.randint(jax.random.PRNGKey(b + 1), (b, MAX_LOGIT_BIAS), 0, v, jnp.int32)
        bias = {"": None, "_bias_unused": jnp.full((b, MAX_LOGIT_BIAS), -1, jnp.int32), "_bias_used": used}
        variants = [("greedy_cond_skips_sort", 0.0, 1.0, ""), ("top_p_sorts", 1.0, 0.9, ""),
                    ("greedy_cond_skips_sort", 0.0, 1.0, "_bias_unused"), ("greedy_cond_skips_sort", 0.0, 1.0, "_bias_used")]
        for name, temp, top_p, with_bias in variants:
            name += with_bias
            ids = bias[with_bias]
            sb = smp.SamplingBatch(
                temperature=jnp.full((b,), temp, jnp.float32), top_p=jnp.full((b,), top_p, jnp.float32),
                top_k=jnp.full((b,), -1, jnp.int32), min_p=jnp.zeros((b,), jnp.float32),
                repetition_penalty=jnp.ones((b,), jnp.float32), frequency_penalty=jnp.zeros((b,), jnp.float32),
                presence_penalty=jnp.zeros((b,), jnp.float32), seed=jnp.arange(b, dtype=jnp.int32),
                step=jnp.zeros((b,), jnp.int32), logit_bias_ids=ids,
                logit_bias_values=None if ids is None else jnp.ones(ids.shape, jnp.float32))
            f = jax.jit(lambda lg, s_: smp.sample(lg, s_, counts, mask, num_top_logprobs=20).tokens)
            f(logits, sb).block_until_ready()
            t = time.perf_counter()
            for _ in range(50):
                r = f(logits, sb)
            r.block_until_ready()
            out[f"B{b}_{name}_ms"] = (time.perf_counter() - t) / 50 * 1e3
    results["sampler"] = out
    log("sampler:", {k: round(x, 3) for k, x in out.items()})


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--models", default="qwen3-8b,qwen3-next-12l")
    ap.add_argument("--grid", default="1:1024,8:1024,32:1024,128:1024,1:8192,8:8192,32:8192")
    ap.add_argument("--budget-s", type=float, default=500)
    ap.add_argument("--skip-peer", action="store_true")
    args = ap.parse_args(argv)
    grid = [tuple(int(x) for x in p.split(":")) for p in args.grid.split(",")]
    budget_end = T0 + args.budget_s
    results = {"device": jax.devices()[0].device_kind, "jax_version": jax.__version__, "commit": commit(),
               "command": "python " + " ".join(sys.argv), "models": []}

    def save():
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    cp = copy_bandwidth(2 << 30)
    results["copy"] = cp
    log(f"copy bandwidth {cp['bytes_per_s'] / 1e12:.2f} TB/s ({cp['how']})")
    save()
    try:
        if jax.default_backend() == "gpu":  # [128, 152k] sorts take minutes on a CPU
            sampler_bench(results)
    except Exception as e:  # noqa: BLE001
        results.setdefault("errors", []).append(f"sampler: {e!r}"[:500])
    save()
    cache_dir = tempfile.mkdtemp(prefix="jspec-xla-")
    for preset in args.models.split(","):
        try:
            model = bench_model(preset, grid,
                                cp["bytes_per_s"], results, budget_end, cache_dir)
            save()
            if preset == args.models.split(",")[0] and time.perf_counter() < budget_end:
                engine_e2e(model, results)
                save()
                if not args.skip_peer and time.perf_counter() < budget_end:
                    hf_peer(model, preset, results)
                    save()
            del model
        except Exception as e:  # noqa: BLE001
            import traceback

            traceback.print_exc()
            results.setdefault("errors", []).append(f"{preset}: {type(e).__name__}: {str(e)[:500]}")
            save()
    log("done")
    save()


if __name__ == "__main__":
    main()
