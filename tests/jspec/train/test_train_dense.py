"""The dense training forward equals jspec's paged forward and transformers (fp32): logits,
final hidden states and captured aux streams; the chunked delta rule equals the token-by-token
reference, gradients included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jspec.cache.pool import allocate_caches
from jspec.models import load_model
from jspec.models.scoring import SCORE_PAGE_SIZE, forward, single_sequence_batch
from jspec.train.chunked_gdn import causal_conv1d, chunk_gated_delta_rule
from jspec.train.dense import dense_forward
from pallas_kernels.gdn import reference as gdn_ref
from tests.support import models as tm
from tests.support.models import rel_err

TOL = 1e-4
T = 70  # crosses a 64-token GDN chunk


def paged(model, ids, capture):
    """(logits, final hidden, aux) of one sequence through the engine's paged path."""
    padded = 1 << (len(ids) - 1).bit_length()
    batch = single_sequence_batch(ids, page_size=SCORE_PAGE_SIZE, padded_len=padded)
    caches = allocate_caches(model.config, num_pages=padded // SCORE_PAGE_SIZE, page_size=SCORE_PAGE_SIZE,
                          num_state_slots=1, dtype=model.dtype)
    out, _ = forward(model, caches, batch, capture_layers=capture)
    n = len(ids)
    return np.asarray(out.logits[:n]), np.asarray(out.final_hidden[:n]), np.asarray(out.aux_hidden[:n])


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_next", "qwen3_moe"])
def test_dense_equals_paged_and_transformers(arch, tiny_checkpoint):
    import torch

    hf = tiny_checkpoint.hf(arch, 5)
    model = load_model(tiny_checkpoint(arch, 5), dtype="float32")
    n = model.config.num_hidden_layers
    capture = (0, 1, n)
    ids = np.stack([tm.random_ids(T, seed=1), tm.random_ids(T, seed=2)])
    module = model.module()
    logits, final, aux = jax.jit(lambda x: dense_forward(module, x, capture_layers=capture))(jnp.asarray(ids))
    assert logits.shape == (2, T, model.config.vocab_size) and logits.dtype == jnp.float32
    assert aux.shape == (2, T, len(capture), model.config.hidden_size)
    with torch.no_grad():
        hf_out = hf(torch.tensor(ids), output_hidden_states=True)
    for r in range(2):
        assert rel_err(logits[r], hf_out.logits[r].numpy()) < TOL, (arch, r)
        for j, layer in enumerate(capture[:-1]):  # HF's last hidden state is after the final norm
            assert rel_err(aux[r, :, j], hf_out.hidden_states[layer][r].numpy()) < TOL, (arch, layer)
    p_logits, p_final, p_aux = paged(model, ids[0], capture)
    assert rel_err(logits[0], p_logits) < TOL
    assert rel_err(final[0], p_final) < TOL
    assert rel_err(aux[0], p_aux) < TOL


def test_chunked_delta_rule_equals_reference():
    rng = np.random.default_rng(0)
    b, t, hk, hv, dk, dv = 2, 80, 2, 4, 16, 8
    f32 = lambda *s: jnp.asarray(rng.normal(size=s), jnp.float32)  # noqa: E731
    q, k, v = f32(b, t, hk, dk), f32(b, t, hk, dk), f32(b, t, hv, dv)
    g = -jnp.abs(f32(b, t, hv)) * 0.5
    beta = jax.nn.sigmoid(f32(b, t, hv))

    def flat(a):
        return a.reshape((b * t,) + a.shape[2:])

    def reference(q, k, v, g, beta):
        cu = jnp.arange(b + 1, dtype=jnp.int32) * t
        o, pool = gdn_ref.gated_delta_rule(flat(q), flat(k), flat(v), flat(g), flat(beta),
                                           jnp.zeros((b, hv, dk, dv)), cu, jnp.arange(b, dtype=jnp.int32),
                                           jnp.zeros(b, bool))
        return o.reshape(b, t, hv, dv), pool

    o, state = jax.jit(chunk_gated_delta_rule)(q, k, v, g, beta)
    ro, rstate = jax.jit(reference)(q, k, v, g, beta)
    assert rel_err(o, np.asarray(ro)) < 1e-5 and rel_err(state, np.asarray(rstate)) < 1e-5

    # Gradients through the chunked form equal those of the recurrence.
    w = f32(b, t, hv, dv)
    grads = jax.jit(jax.grad(lambda *a: jnp.sum(chunk_gated_delta_rule(*a)[0] * w), argnums=(0, 1, 2, 3, 4)))(
        q, k, v, g, beta)
    rgrads = jax.jit(jax.grad(lambda *a: jnp.sum(reference(*a)[0] * w), argnums=(0, 1, 2, 3, 4)))(
        q, k, v, g, beta)
    for got, ref in zip(grads, rgrads):
        assert rel_err(got, np.asarray(ref)) < 1e-4

    x, weight = f32(b, t, 12), f32(12, 4)
    cu = jnp.arange(b + 1, dtype=jnp.int32) * t
    ry, _ = gdn_ref.causal_conv1d(flat(x), weight, jnp.zeros((b, 12, 3)), cu, jnp.arange(b, dtype=jnp.int32),
                                  jnp.zeros(b, bool))
    assert rel_err(jax.jit(causal_conv1d)(x, weight), np.asarray(ry).reshape(b, t, 12)) < 1e-6
