"""Every supported architecture against transformers (fp32, CPU): whole prompt, chunked prefill
through the paged cache and state pool, and token-by-token decode after a prefill."""

from __future__ import annotations

import numpy as np
import pytest

from jspec.models import load_model
from jspec.models.batch import ForwardMode
from tests.support import models as tm
from tests.support.models import rel_err
from tests.support.paged import PagedHarness

TOL = 1e-4
ARCHS = list(tm.SPECS)


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tiny_checkpoint):
    """(hf torch model, jspec model) built from one saved checkpoint per architecture."""
    name, seed = request.param, ARCHS.index(request.param)
    return name, tiny_checkpoint.hf(name, seed), load_model(tiny_checkpoint(name, seed), dtype="float32")


def test_whole_prompt(pair):
    name, hf, m = pair
    ids = tm.random_ids(23, seed=1)
    assert rel_err(m.score(ids), tm.hf_logits(hf, ids)) < TOL, name


def test_chunked_prefill_and_decode(pair):
    """Three requests share every step: chunks of uneven sizes (crossing pages of 4 tokens), then
    decode steps for all of them, each compared with transformers on the full sequence."""
    name, hf, m = pair
    rng = np.random.default_rng(7)
    seqs = {sid: tm.random_ids(n, seed=10 + sid) for sid, n in enumerate((19, 6, 13))}
    prompt_len = {0: 14, 1: 6, 2: 9}
    refs = {sid: tm.hf_logits(hf, s) for sid, s in seqs.items()}
    got = {sid: [] for sid in seqs}
    h = PagedHarness(m, page_size=4, num_slots=6, pages_per_seq=8, seed=3)

    done = {sid: 0 for sid in seqs}
    while any(done[s] < prompt_len[s] for s in seqs):
        chunks = {}
        for sid in seqs:
            left = prompt_len[sid] - done[sid]
            if left > 0:
                n = int(min(left, rng.integers(1, 7)))
                chunks[sid] = seqs[sid][done[sid]: done[sid] + n]
                done[sid] += n
        for sid, lg in h.step(chunks, num_tokens=16, batch_size=4).items():
            got[sid].append(lg)

    while any(done[s] < len(seqs[s]) for s in seqs):
        chunks = {}
        for sid in seqs:
            if done[sid] < len(seqs[sid]):
                chunks[sid] = [seqs[sid][done[sid]]]
                done[sid] += 1
        for sid, lg in h.step(chunks, num_tokens=4, batch_size=4, mode=ForwardMode.DECODE).items():
            got[sid].append(lg)

    for sid in seqs:
        full = np.concatenate(got[sid])
        assert full.shape == refs[sid].shape
        assert rel_err(full, refs[sid]) < TOL, (name, sid)
