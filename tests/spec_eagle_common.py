"""Shared set-up of the EAGLE-family engine tests: tiny targets, drafters in their published
formats (random ones, and "agreeing" ones built to match a near-bigram target), the reference
greedy outputs, and an engine factory."""

from __future__ import annotations

import tiny_drafters as td
import tiny_models as tm

from jspec import Engine

# Greedy engines compile no top-k / top-p step variants (a test that samples with top_p < 1 asks
# for them back).
BASE = dict(dtype="float32", cuda_graph_bs=[4], max_running_requests=4, show_progress=False,
            compilation_cache_dir="none", chunked_prefill_size=8, context_length=96, disable_top_k_top_p=True)
# Mixed lengths; with chunked prefill 8 the long ones take several chunks, the short one is one token.
PROMPTS = [tm.random_ids(n, seed=200 + n) for n in (5, 19, 1, 12, 9)]
GREEDY = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}

BUILDERS = {
    "qwen3": lambda d: tm.build("qwen3", d["qwen3"], seed=41),
    "eagle": lambda d: td.write_eagle(d["eagle"], d["qwen3"], seed=1),
    "eagle3": lambda d: td.write_eagle3(d["eagle3"], d["qwen3"], seed=2, draft_vocab=60),
    "qnext": lambda d: (tm.build("qwen3_next", d["qnext"], seed=5), td.add_mtp(d["qnext"], seed=3)),
    "bigram": lambda d: (tm.build("qwen3", d["bigram"], seed=43), td.make_near_bigram(d["bigram"], 0)),
    "agree_eagle": lambda d: td.write_agreeing_eagle(d["agree_eagle"], d["bigram"], seed=4),
    "bigram_next": lambda d: (tm.build("qwen3_next", d["bigram_next"], seed=6),
                              td.add_agreeing_mtp(d["bigram_next"], seed=7)),
    # Flattened (top token ~0.5 at temperature 1) so that sampling rejects drafts often.
    "flat": lambda d: (tm.build("qwen3", d["flat"], seed=43), td.make_near_bigram(d["flat"], 0, logit_scale=0.07)),
    "agree_flat": lambda d: td.write_agreeing_eagle(d["agree_flat"], d["flat"], seed=4, logit_scale=0.07),
    "llama": lambda d: tm.build("llama", d["llama"], seed=44),
    "llama_eagle": lambda d: td.write_eagle(d["llama_eagle"], d["llama"], seed=9, embed=False),
}


def build_models(root, names) -> dict:
    """Directories for `names` (in BUILDERS order, targets before their drafters) under root."""
    d = {k: str(root / k) for k in BUILDERS}
    for k in BUILDERS:
        if k in names:
            BUILDERS[k](d)
    return {k: d[k] for k in names}


_refs: dict = {}


def reference(target: str, page_size: int = 4):
    """Non-speculative greedy outputs of PROMPTS (cached per target directory)."""
    if target not in _refs:
        eng = Engine(target, page_size=page_size, **BASE)
        try:
            _refs[target] = [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
        finally:
            eng.shutdown()
    return _refs[target]


def spec_engine(models, algo, target, draft, *, steps, topk, ndt, page_size, **kw):
    extra = {} if draft is None else dict(speculative_draft_model_path=models[draft])
    return Engine(models[target], page_size=page_size, speculative_algorithm=algo, speculative_num_steps=steps,
                  speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt, **extra, **{**BASE, **kw})
