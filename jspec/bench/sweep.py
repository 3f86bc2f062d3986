"""`jspec bench sweep`: speculative settings x max concurrency, one engine per setting.

The grid's rows are (overlap, max concurrency); its columns are engine settings: no speculation
first (every row's baseline; `--skip-baseline` leaves it out), then each algorithm x num_steps x topk x
num_draft_tokens x simulated accept length. A setting whose Engine cannot be built (an algorithm
not implemented yet, a bad combination) gives error records and the sweep goes on.
"""

from __future__ import annotations

import argparse
import gc
import itertools

from jspec.bench.record import fmt, append_jsonl, environment, make_record
from jspec.bench.serve import SPEC_KEYS, engine_kwargs, measure, open_model, settings, with_draft


def grid(args) -> list[dict]:
    """Engine settings to run, baseline first; speculative knobs are None without an algorithm."""
    algos = [a for a in args.speculative_algorithm_list if a is not None]
    out = []
    for overlap in args.overlap_list:
        if not getattr(args, "skip_baseline", False):
            out.append({"overlap": overlap, **{k: None for k in SPEC_KEYS}})
        for algo in algos:
            for steps, topk, ndraft, sim in itertools.product(
                args.speculative_num_steps_list, args.speculative_eagle_topk_list,
                args.speculative_num_draft_tokens_list, args.speculative_simulate_accept_length_list or [None],
            ):
                out.append({"overlap": overlap, "speculative_algorithm": algo, "speculative_num_steps": steps,
                            "speculative_eagle_topk": topk, "speculative_num_draft_tokens": ndraft,
                            "speculative_draft_model_path": args.speculative_draft_model_path,
                            "speculative_simulate_accept_length": sim})
    return out


def row_key(rec: dict) -> tuple:
    """Records compare only on the same model, workload (every workload flag) and schedule."""
    workload = tuple(sorted((k, str(v)) for k, v in rec["settings"].items() if k != "max_concurrency"))
    return (workload, not rec["engine_args"].get("disable_overlap_schedule", False),
            rec["settings"].get("max_concurrency"))


def attach_speedups(records: list[dict]) -> None:
    """speedup = output tokens/s over that of the no-speculation record of the same row."""
    base = {row_key(r): r["metrics"]["output_throughput"] for r in records
            if r.get("metrics") and not (r.get("speculative") or {}).get("speculative_algorithm")}
    for r in records:
        b = base.get(row_key(r))
        r["speedup"] = r["metrics"]["output_throughput"] / b if r.get("metrics") and b else None


def _engine_args(args, cfg: dict) -> dict:
    kw = engine_kwargs(args)
    kw["disable_overlap_schedule"] = not cfg["overlap"]
    kw.update({k: cfg[k] for k in SPEC_KEYS if cfg[k] is not None})
    return kw


def _point_args(args, cfg: dict, concurrency: int) -> argparse.Namespace:
    a = argparse.Namespace(**vars(args))
    a.max_concurrency = concurrency
    if getattr(args, "prompts_per_concurrency", None):
        # Scale the workload with the cap: concurrency 1 then does not take 128x longer than 128.
        a.num_prompts = args.prompts_per_concurrency * concurrency
    for k in SPEC_KEYS:
        setattr(a, k, cfg[k])
    return a


def run_sweep(args, command: str, engine_factory=None) -> list[dict]:
    """`engine_factory(model_path, **kwargs)` builds each engine (default `jspec.Engine`; tests
    pass a stand-in that speculates)."""
    if engine_factory is None:
        from jspec.api import Engine as engine_factory

    env = environment()
    model = open_model(args)  # random weights are built once and shared by every engine
    records: list[dict] = []
    for cfg in grid(args):
        kw = _engine_args(args, cfg)
        spec = {k: cfg[k] for k in SPEC_KEYS}
        try:
            engine = engine_factory(model, **with_draft(kw, model, args))
        except Exception as e:  # noqa: BLE001 - record it, go on with the next setting
            engine, build_error = None, f"{type(e).__name__}: {e}"
        for c in args.max_concurrency_list:
            pa = _point_args(args, cfg, c)
            if engine is None:
                rec = make_record("sweep", command, settings(pa), {"model_path": args.model_path, **kw}, env,
                                  speculative=spec, metrics=None, error=build_error)
            else:
                try:
                    rec = measure(engine, pa, kw, env, command, kind="sweep")
                except Exception as e:  # noqa: BLE001
                    rec = make_record("sweep", command, settings(pa), {"model_path": args.model_path, **kw},
                                      env, speculative=spec, metrics=None, error=f"{type(e).__name__}: {e}")
            records.append(rec)
            attach_speedups(records)  # the baseline of a row always runs before the row's others
            append_jsonl(args.output_file, [rec])
            print(sweep_line(rec), flush=True)
        if engine is not None:
            # The next engine sizes its pool from the device's memory: this one gives it all back
            # first (shutdown frees its buffers; dropping it frees a random drafter built for it).
            engine.shutdown()
            engine = None
            gc.collect()
    print(sweep_table(records))
    print(f"{len(records)} records appended to {args.output_file}")
    return records


_COLS = ("algorithm", "steps", "topk", "draft", "sim_acc", "overlap", "conc", "accept_len", "out_tok/s",
         "speedup", "pages", "retract", "status")


def _cells(r: dict) -> list[str]:
    sp, m = r.get("speculative") or {}, r.get("metrics") or {}
    status = "ok" if r.get("error") is None else r["error"]
    if r.get("error") is None and m.get("failed"):
        status = f"{m['failed']} failed"
    return [sp.get("speculative_algorithm") or "none", fmt(sp.get("speculative_num_steps")),
            fmt(sp.get("speculative_eagle_topk")), fmt(sp.get("speculative_num_draft_tokens")),
            fmt(sp.get("speculative_simulate_accept_length")),
            "off" if r["engine_args"].get("disable_overlap_schedule") else "on",
            fmt(r["settings"].get("max_concurrency")), fmt(m.get("accept_length")),
            fmt(m.get("output_throughput"), ".1f"), fmt(r.get("speedup"), ".3f"), fmt(r.get("num_total_pages")),
            fmt(r.get("num_retractions")), status[:120]]


def sweep_line(r: dict) -> str:
    return "  ".join(f"{c}={v}" for c, v in zip(_COLS, _cells(r)))


def sweep_table(records: list[dict]) -> str:
    rows = [list(_COLS)] + [_cells(r) for r in records]
    widths = [max(len(row[i]) for row in rows) for i in range(len(_COLS) - 1)]
    lines = ["  ".join(c.rjust(w) for c, w in zip(row[:-1], widths)) + "  " + row[-1] for row in rows]
    lines.insert(1, "-" * len(lines[0]))
    return "\n".join(lines)
