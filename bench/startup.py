"""Engine start-up in fresh processes, as a restarted server sees it (bench/README.md, "Start-up").

Three runs of the same engine (random weights of a preset's shape, the default bucket set unless
engine keywords say otherwise; `"speculative_draft_model_path": "random"` builds a random drafter), each a new Python process sharing one cache folder:
  cold:        empty caches: trace, lower and compile every bucket;
  warm_xla:    XLA's persistent cache only (`JSPEC_EXECUTABLE_CACHE=0`): trace and lower, then load;
  warm:        jspec's compiled-step cache as well: load every bucket, no tracing.
Each run reports the engine's construction time (pool sizing, compile, warm-up), the runner's
compile seconds, the bucket count and the cache's hits, then one short request's latency.
`--profile-dir DIR` also runs each engine's construction under cProfile, which sees the main
thread only: the tracing and lowering that every bucket waits for (the compiles run on a pool). It
writes DIR/<run>.prof and DIR/<run>.txt (the functions by own time and by cumulative time); the
profiler slows Python down, so take that run's seconds for attribution, not as start-up figures.

  python3 bench/startup.py --preset qwen3-8b --out $OUT/startup.jsonl [--engine-json '{...}'] [--runs cold]
      [--profile-dir $OUT/startup_prof]
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import subprocess
import sys
import tempfile
import time

RUNS = (("cold", {}), ("warm_xla", {"JSPEC_EXECUTABLE_CACHE": "0"}), ("warm", {}))


def profiled(fn, path: str | None):
    """fn() -> its result; with a path, under cProfile, the stats in path.prof and the top
    functions by own and by cumulative time in path.txt."""
    if path is None:
        return fn()
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    try:
        return prof.runcall(fn)
    finally:
        prof.dump_stats(path + ".prof")
        text = io.StringIO()
        for order in ("tottime", "cumulative"):
            pstats.Stats(prof, stream=text).sort_stats(order).print_stats(40)
        with open(path + ".txt", "w") as f:
            f.write(text.getvalue())


def child(preset: str, cache_dir: str, engine_kw: dict, profile: str | None = None) -> dict:
    t_start = time.perf_counter()
    import jax

    from jspec.api import Engine
    from jspec.bench.record import environment
    from jspec.config import parse_hf_config
    from jspec.models.loader import random_model
    from jspec.models.presets import preset_config

    t_import = time.perf_counter()
    model = random_model(parse_hf_config(preset_config(preset)), dtype="bfloat16", seed=0, scale=0.02)
    jax.block_until_ready(jax.tree_util.tree_leaves(model.params))
    if engine_kw.get("speculative_draft_model_path") == "random":  # a random drafter of the algorithm's format
        from types import SimpleNamespace

        from jspec.bench.serve import with_draft

        engine_kw = with_draft(engine_kw, model, SimpleNamespace(seed=0))
    t_model = time.perf_counter()
    eng = profiled(lambda: Engine(model, compilation_cache_dir=cache_dir, show_progress=False, **engine_kw), profile)
    t_engine = time.perf_counter()
    try:
        v = model.config.vocab_size
        out = eng.generate(input_ids=[(7 * i + 3) % v for i in range(64)],
                           sampling_params={"max_new_tokens": 8, "temperature": 0, "ignore_eos": True})
        t_first = time.perf_counter()
        info = eng.get_server_info()
    finally:
        eng.shutdown()
    return {"import_s": t_import - t_start, "random_weights_s": t_model - t_import,
            "engine_init_s": t_engine - t_model, "compile_s": info["compile_seconds"],
            "workspace_compile_s": info.get("workspace_compile_seconds"),
            "num_buckets": len(info["compile_seconds_per_bucket"]),
            "executable_cache": info.get("executable_cache"), "first_request_s": t_first - t_engine,
            "first_request_tokens": out["meta_info"]["completion_tokens"], "num_total_pages": info["num_total_pages"],
            "memory": info.get("memory"), "compile_seconds_per_bucket": info["compile_seconds_per_bucket"],
            "lower_seconds_per_bucket": info["lower_seconds_per_bucket"],
            "lower_s": sum(info["lower_seconds_per_bucket"].values()),
            "kernel_lowerings": info["kernel_lowerings"],
            **environment()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--preset", default="qwen3-8b")
    ap.add_argument("--out", required=True)
    ap.add_argument("--engine-json", default="{}", help="Engine keywords (default: the default buckets)")
    ap.add_argument("--cache-dir", default=None, help="shared cache folder (default: a new empty one)")
    ap.add_argument("--runs", default=",".join(n for n, _ in RUNS),
                    help="which of cold,warm_xla,warm to run, in that order (a warm run needs the cold one's folder)")
    ap.add_argument("--profile-dir", default=None, help="profile each engine's construction into this folder")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--profile", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    kw = json.loads(args.engine_json)
    if args.child:
        print("RESULT " + json.dumps(child(args.preset, args.cache_dir, kw, args.profile)), flush=True)
        return 0
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="jspec-startup-")
    wanted = set(args.runs.split(","))
    if args.profile_dir:
        os.makedirs(args.profile_dir, exist_ok=True)
    for name, env in RUNS:
        if name not in wanted:
            continue
        t0 = time.perf_counter()
        proc = subprocess.run([sys.executable, __file__, "--child", "--preset", args.preset, "--cache-dir",
                               cache_dir, "--engine-json", args.engine_json, "--out", "-",
                               *(["--profile", os.path.join(args.profile_dir, name)] if args.profile_dir else [])],
                              env={**os.environ, **env}, capture_output=True, text=True)
        wall = time.perf_counter() - t0
        line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
        # Device, versions and commit come from the child (the parent leaves the GPU to the children).
        rec = {"run": name, "preset": args.preset, "engine": kw, "process_wall_s": wall, "command": " ".join(sys.argv),
               "profiled": bool(args.profile_dir)}
        rec["stored_entries"] = len(glob.glob(os.path.join(cache_dir, "executables", "*.jexe")))
        warnings = [x for x in proc.stderr.splitlines() if "executable cache" in x]
        if warnings:
            rec["cache_warnings"] = sorted(set(w[-400:] for w in warnings))[:5]
        if line is None:
            rec["error"] = (proc.stderr or proc.stdout)[-2000:]
        else:
            rec.update(json.loads(line[len("RESULT "):]))
        with open(args.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
        print(f"{name:9s} process {wall:6.1f} s  engine {rec.get('engine_init_s', float('nan')):6.1f} s  "
              f"compile {rec.get('compile_s', float('nan')):6.1f} s  "
              f"workspace {rec.get('workspace_compile_s', float('nan')):5.1f} s  lowering {rec.get('lower_s', float('nan')):5.1f} s  "
              f"buckets {rec.get('num_buckets')}  "
              f"exe cache {rec.get('executable_cache')}  first request {rec.get('first_request_s', float('nan')):.2f} s"
              + f"  entries {rec['stored_entries']}" + (f"  WARNINGS {rec['cache_warnings']}" if "cache_warnings" in rec else "")
              + (f"  ERROR {rec['error'][-300:]}" if "error" in rec else ""), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
