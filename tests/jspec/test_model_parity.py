"""Every supported architecture against transformers (fp32, CPU): whole prompt, chunked prefill
through the paged cache and state pool, and token-by-token decode after a prefill."""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest

sys.path.insert(0, os.path.dirname(os.path.dirname(__file__)))
import tiny_models as tm  # noqa: E402
from paged_harness import PagedHarness  # noqa: E402

from jspec.models import load_model  # noqa: E402
from jspec.models.batch import ForwardMode  # noqa: E402

TOL = 1e-4
ARCHS = list(tm.SPECS)


def rel_err(got, ref):
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


@pytest.fixture(scope="module", params=ARCHS)
def pair(request, tmp_path_factory):
    """(hf torch model, jspec model) built from one saved checkpoint per architecture."""
    d = str(tmp_path_factory.mktemp(request.param))
    hf = tm.build(request.param, d, seed=ARCHS.index(request.param))
    return request.param, hf, load_model(d, dtype="float32")


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
