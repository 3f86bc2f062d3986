"""The sampling check of the speculative-decoding tests: many seeded two-token requests, and the
chi-square test that the token a speculative step produced follows the target's own distribution."""

from __future__ import annotations

import numpy as np

from tests.support import models as tm
from tests.support.engines import check_no_leaks


def _filtered(logits, temperature, top_p):
    """numpy: softmax(logits / T) restricted to the top-p prefix (mass before a token < top_p)."""
    z = logits / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    order = np.argsort(-p, kind="stable")
    before = np.cumsum(p[order]) - p[order]
    keep = np.zeros_like(p, dtype=bool)
    keep[order] = before < top_p if top_p < 1 else True
    p = np.where(keep, p, 0.0)
    return p / p.sum()


# Engine settings for two_token_draws: 32 requests per step, and every prompt of a step prefilled
# in one chunk.
DRAWS = dict(cuda_graph_bs=[32], max_running_requests=32, chunked_prefill_size=256, prefill_token_buckets=[256])


def two_token_draws(eng, prompt, n: int, temperature: float, top_p: float):
    """n seeded requests of two tokens from one prompt: the first comes from prefill, the second
    always from a speculative step. Checks that nothing leaked."""
    sps = [{"max_new_tokens": 2, "temperature": temperature, "top_p": top_p, "seed": i, "ignore_eos": True}
           for i in range(n)]
    outs = eng.generate(input_ids=[prompt] * n, sampling_params=sps)
    check_no_leaks(eng)
    return outs


def second_token_follows_target(outs, prompt, target_dir, temperature, top_p):
    """The second output token always comes out of a speculative step (accepted draft or residual
    draw). Given the first token, its law must be the target's own, not the drafter's: chi-square
    of its counts against transformers' distribution for each observed first token."""
    import torch
    import transformers
    from scipy import stats

    pairs = np.array([o["output_ids"] for o in outs])
    assert pairs.shape == (len(outs), 2)
    hf = transformers.AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    expected = np.zeros(tm.VOCAB)
    for first in np.unique(pairs[:, 0]):
        count = int(np.sum(pairs[:, 0] == first))
        logits = tm.hf_logits(hf, prompt + [int(first)])[-1].astype(np.float64)
        expected += count * _filtered(logits, temperature, top_p)
    observed = np.bincount(pairs[:, 1], minlength=tm.VOCAB).astype(float)
    assert observed[expected == 0].sum() == 0, "a token outside the target's support was produced"
    big = expected >= 5
    obs = np.append(observed[big], observed[~big].sum())
    exp = np.append(expected[big], expected[~big].sum())
    if exp[-1] < 5:  # too little mass to pool separately: fold it into the largest bin
        obs, exp = obs[:-1], exp[:-1]
        obs[np.argmax(exp)] += observed[~big].sum()
        exp[np.argmax(exp)] += expected[~big].sum()
    chi2 = float(np.sum((obs - exp) ** 2 / exp))
    p_value = stats.chi2.sf(chi2, df=len(exp) - 1)
    assert p_value > 1e-3, (chi2, len(exp), p_value)

