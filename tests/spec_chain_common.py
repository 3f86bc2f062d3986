"""Shared set-up of the chain speculative-decoding tests (STANDALONE in test_spec_chain.py, NGRAM in
test_spec_ngram.py; two files so that `pytest -n 2 --dist loadfile` can run them side by side): the
tiny target and a draft of another architecture, the prompts, and the non-speculative greedy
reference."""

from __future__ import annotations

import tiny_models as tm

from jspec import Engine

BASE = dict(dtype="float32", cuda_graph_bs=[1, 2, 4], max_running_requests=4, show_progress=False,
            compilation_cache_dir="none", chunked_prefill_size=8, context_length=96, disable_top_k_top_p=True)

# The last prompt plus 13 new tokens ends exactly at the context length (96): speculative steps
# there write draft positions past it, which the page table must cover.
PROMPTS = [tm.random_ids(n, seed=100 + n) for n in (5, 19, 11, 2, 14, 83)]
GREEDY = {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True}


def build_dirs(tmp_path_factory) -> tuple[str, str]:
    target = str(tmp_path_factory.mktemp("spec_target"))
    draft = str(tmp_path_factory.mktemp("spec_draft"))
    tm.build("qwen3", target, seed=41)
    tm.build("llama", draft, seed=42)  # a different architecture, same vocabulary
    return target, draft


def reference(target: str) -> list[list[int]]:
    """Non-speculative greedy outputs of PROMPTS. The oracle engine compiles one decode batch size
    (shorter batches run padded, CI time): a plain engine's batch-size buckets and its parity with
    transformers are test_engine.py's business."""
    eng = Engine(target, page_size=16, **{**BASE, "cuda_graph_bs": [4]})
    try:
        return [o["output_ids"] for o in eng.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    finally:
        eng.shutdown()
