"""A model run through the Pallas kernels (interpret mode) gives the reference path's logits: ragged
prompt chunks, then decode steps, several requests per step, on one device. This exercises the
kernels as the layers call them (`ops`): the add + RMSNorm before every mixer and MLP, the q / k
norm + rotary + KV write (gated and partly rotated for hybrids), the two-part prompt attention,
paged attention and decode, and for hybrids the Gated DeltaNet kernels."""

from __future__ import annotations

import functools

import jax
import numpy as np
import pytest

from jspec.models import dispatch, scoring
from jspec.models.batch import ForwardMode
from jspec.models.loader import load_model
from tests.support import models as tm
from tests.support import paged


def run(model, backend, monkeypatch):
    """Logits of every step of one fixed schedule, traced under `backend` (its own jit)."""
    fn = jax.jit(functools.partial(scoring._forward, model.graphdef), static_argnames=("capture_layers",))

    def forward(model, caches, batch):
        with dispatch.use_backend(backend):
            return fn(model.params, caches, batch, None, ())

    monkeypatch.setattr(paged, "forward", forward)
    h = paged.PagedHarness(model, page_size=4, num_slots=6, pages_per_seq=8, seed=3)
    seqs = {sid: tm.random_ids(n, seed=20 + sid) for sid, n in enumerate((11, 5, 8))}
    out = []
    out.append(h.step({0: seqs[0][:7], 1: seqs[1][:5], 2: seqs[2][:4]}, num_tokens=16, batch_size=4))
    out.append(h.step({0: seqs[0][7:], 2: seqs[2][4:]}, num_tokens=16, batch_size=4))
    for j in range(3):
        out.append(h.step({sid: [int(seqs[sid][j])] for sid in seqs}, num_tokens=4, batch_size=4,
                          mode=ForwardMode.DECODE))
    return out


@pytest.mark.parametrize("family", ["qwen3", "llama", "qwen3_next"])
def test_kernel_path_matches_reference(tiny_checkpoint, family, monkeypatch):
    model = load_model(tiny_checkpoint(family, 7), dtype="float32")
    want = run(model, "reference", monkeypatch)
    got = run(model, "interpret", monkeypatch)
    for step, (g, w) in enumerate(zip(got, want)):
        assert g.keys() == w.keys()
        for sid in w:
            np.testing.assert_allclose(g[sid], w[sid], rtol=2e-4, atol=2e-4, err_msg=f"{family} step {step} req {sid}")
