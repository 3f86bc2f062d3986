"""Shared set-up of the EAGLE-family engine tests (test_spec_eagle.py, test_spec_eagle_agree.py,
test_spec_eagle_hybrid.py): tiny targets, drafters in their published formats (random ones, and
"agreeing" ones built to match a near-bigram target), the reference greedy outputs, an engine
factory, and the checks that the dense and hybrid files both run."""

from __future__ import annotations

from tests.support import drafters as td
from tests.support import models as tm
from tests.support.engines import SPEC_BS4, check_no_leaks, generates

from jspec import Engine

# Greedy engines compile no top-k / top-p step variants (a test that samples with top_p < 1 asks
# for them back).
BASE = SPEC_BS4
# Mixed lengths; with chunked prefill 8 the long ones take several chunks, the short one is one token.
PROMPTS = [tm.random_ids(n, seed=200 + n) for n in (5, 19, 1, 12, 9)]
GREEDY = {"max_new_tokens": 14, "temperature": 0, "ignore_eos": True}

# Plain targets nothing writes into: the session's tiny_checkpoint (shared with other files).
SHARED = {"qwen3": ("qwen3", 41), "llama": ("llama", 44)}
BUILDERS = {
    "eagle": lambda d: td.write_eagle(d["eagle"], d["qwen3"], seed=1),
    "eagle3": lambda d: td.write_eagle3(d["eagle3"], d["qwen3"], seed=2, draft_vocab=60),
    "bigram": lambda d: (tm.build("qwen3", d["bigram"], seed=43), td.make_near_bigram(d["bigram"], 0)),
    "agree_eagle": lambda d: td.write_agreeing_eagle(d["agree_eagle"], d["bigram"], seed=4),
    "bigram_next": lambda d: (tm.build("qwen3_next", d["bigram_next"], seed=6),
                              td.add_agreeing_mtp(d["bigram_next"], seed=7)),
    # Flattened (top token ~0.5 at temperature 1) so that sampling rejects drafts often.
    "flat": lambda d: (tm.build("qwen3", d["flat"], seed=43), td.make_near_bigram(d["flat"], 0, logit_scale=0.07)),
    "agree_flat": lambda d: td.write_agreeing_eagle(d["agree_flat"], d["flat"], seed=4, logit_scale=0.07),
    "llama_eagle": lambda d: td.write_eagle(d["llama_eagle"], d["llama"], seed=9, embed=False),
    "block_bigram": lambda d: (tm.build("qwen3", d["block_bigram"], seed=42), td.make_block_bigram(d["block_bigram"])),
    "agree_dflash": lambda d: td.write_agreeing_dflash(d["agree_dflash"], d["block_bigram"], block_size=4),
}


def build_models(root, names, tiny_checkpoint) -> dict:
    """Directories for `names`: SHARED ones from the tiny_checkpoint fixture, the others built under
    root (in BUILDERS order, targets before their drafters)."""
    d = {k: str(root / k) for k in BUILDERS}
    d.update({k: tiny_checkpoint(*SHARED[k]) for k in SHARED if k in names})
    for k in BUILDERS:
        if k in names:
            BUILDERS[k](d)
    return {k: d[k] for k in names}


def case_kwargs(dirs, case) -> dict:
    """Engine keywords of a family test case (algorithm, target, drafter, num_steps, topk,
    num_draft_tokens, overlap), the drafter read from dirs: overlapped (v2) cases run under
    transfer_guard("disallow"), the others with overlap off (v1); DFLASH takes no tree keys."""
    algo, _, draft, steps, topk, ndt, overlap = case
    kw = dict(speculative_algorithm=algo, speculative_num_steps=steps)
    if algo != "DFLASH":
        kw.update(speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt)
    if draft is not None:
        kw["speculative_draft_model_path"] = dirs[draft]
    kw.update(dict(transfer_guard="disallow") if overlap else dict(disable_overlap_schedule=True))
    return kw


def reference(greedy_reference, target: str, engine=None) -> list[list[int]]:
    """Non-speculative greedy outputs of PROMPTS (the session's greedy_reference fixture caches
    them per target). engine: a plain engine of that target (BASE settings, page size 4) to serve
    them, kept running."""
    return greedy_reference(target, PROMPTS, GREEDY, page_size=4, settings=BASE, engine=engine)


def spec_engine(models, algo, target, draft, *, steps, topk, ndt, page_size, **kw):
    extra = {} if draft is None else dict(speculative_draft_model_path=models[draft])
    return Engine(models[target], page_size=page_size, speculative_algorithm=algo, speculative_num_steps=steps,
                  speculative_eagle_topk=topk, speculative_num_draft_tokens=ndt, **extra, **{**BASE, **kw})


# Plain temperature (top-k / top-p through a tree: test_tree_sampling_follows_the_target_distribution).
SAMPLED = [{"max_new_tokens": 14, "temperature": 0.8, "seed": 11 + i, "ignore_eos": True} for i in range(2)]


def check_agreeing_drafter(models, algo, target, draft, topk, ndt, compare_v1, ref):
    """Drafts that the target mostly keeps: exercises multi-token acceptance, tree walks, the KV
    move of accepted tree nodes, hybrid commits past node 0 and the drafter's catch-up. Runs in
    spec v2 (overlap, the default) with the loop under transfer_guard("disallow"): no
    device-to-host transfer beyond each step's explicit output fetch. Where marked, the
    synchronous loop (v1) must give the same outputs, greedy and seeded sampling alike. ref: the
    target's greedy outputs of PROMPTS."""
    sps = [GREEDY] * 3 + SAMPLED
    outs = {}
    for mode in ("v2", "v1") if compare_v1 else ("v2",):
        extra = dict(transfer_guard="disallow") if mode == "v2" else dict(disable_overlap_schedule=True)
        eng = spec_engine(models, algo, target, draft, steps=3, topk=topk, ndt=ndt, page_size=4, **extra)
        try:
            res = eng.generate(input_ids=PROMPTS, sampling_params=sps)
            outs[mode] = [o["output_ids"] for o in res]
            assert eng.get_server_info()["last_error"] is None
            # Greedy rows keep most drafts (sampled ones, at temperature 0.8, fewer).
            greedy_accept = [o["meta_info"]["spec_accept_length"] for o in res[:3]]
            assert min(greedy_accept) > 2.5, greedy_accept
            check_no_leaks(eng)
        finally:
            eng.shutdown()
    assert outs["v2"][:3] == ref[:3]
    if compare_v1:
        assert outs["v1"] == outs["v2"]


def check_naive_eagle(models, target, draft, ref):
    """NAIVE_EAGLE: [last, one draft] verified per step, the drafter's format read from its
    config.json (EAGLE), or the target's MTP layer without a draft path; ref: the target's greedy
    outputs of PROMPTS."""
    eng = spec_engine(models, "NAIVE_EAGLE", target, draft, steps=None, topk=None, ndt=None, page_size=4)
    try:
        generates(eng, PROMPTS, GREEDY, ref)
        info = eng.get_server_info()
        assert info["speculative_num_draft_tokens"] == 2 and 1.5 < info["avg_spec_accept_length"] <= 2.0
        check_no_leaks(eng)
    finally:
        eng.shutdown()
