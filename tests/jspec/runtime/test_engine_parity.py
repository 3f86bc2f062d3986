"""Engine greedy output equal to transformers' greedy generation on every target architecture
(dense, tied and untied heads, MoE, hybrid Gated-DeltaNet), page sizes 1 and 16, overlapped and
synchronous loops, with and without mixed prefill / decode steps; no page or slot left behind.
Split from test_engine.py so that `-n 2 --dist loadfile` runs the two files side by side."""

from __future__ import annotations

import pytest
import torch

from jspec import Engine
from tests.support import models as tm
from tests.support.engines import SMALL, check_no_leaks


def hf_greedy(hf, prompt, n):
    out = hf.generate(torch.tensor([prompt]), max_new_tokens=n, do_sample=False, eos_token_id=None,
                      pad_token_id=0, attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
    return out[0, len(prompt):].tolist()


PARITY = [("llama", 1, False), ("qwen3", 16, False), ("qwen3_moe", 16, True), ("qwen3_next", 1, False),
          ("qwen3_next", 16, True)]


@pytest.mark.parametrize("arch,page_size,mixed", PARITY)
def test_greedy_matches_transformers(tiny_checkpoint, arch, page_size, mixed):
    d, hf = tiny_checkpoint(arch, 30 + page_size), tiny_checkpoint.hf(arch, 30 + page_size)
    prompts = [tm.random_ids(n, seed=n) for n in (5, 23, 11, 2, 17, 8)]
    eng = Engine(d, page_size=page_size, chunked_prefill_size=8, context_length=64, disable_top_k_top_p=True,
                 disable_overlap_schedule=(page_size == 1), enable_mixed_chunk=mixed, **SMALL)
    try:
        outs = eng.generate(input_ids=prompts, sampling_params={"max_new_tokens": 10, "temperature": 0,
                                                                "ignore_eos": True})
        for p, o in zip(prompts, outs):
            assert o["output_ids"] == hf_greedy(hf, p, 10), (arch, page_size, p)
            assert o["meta_info"]["finish_reason"] == {"type": "length", "length": 10}
            assert o["meta_info"]["prompt_tokens"] == len(p) and o["meta_info"]["completion_tokens"] == 10
        assert (eng.scheduler.num_mixed_decode_rows > 0) == mixed
        check_no_leaks(eng)
    finally:
        eng.shutdown()
