"""The two routed-expert paths of SparseMoE (gather for decode / verify batches, grouped GEMM for
prefill) agree, and the dispatching call picks them by GATHER_MAX_TOKENS."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.config import parse_hf_config
from jspec.models import dispatch, mlp
from jspec.models.mlp import SparseMoE
from jspec.models.presets import preset_config


def make_moe():
    cfg = parse_hf_config(dict(preset_config("tiny-qwen3-moe"), num_experts=16, num_experts_per_tok=3))
    moe = SparseMoE(cfg, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    for path, leaf in nnx.state(moe).flat_state():
        leaf.set_value(jnp.asarray(rng.normal(0, 0.1, leaf.get_value().shape), jnp.float32))
    return cfg, moe, rng


def route(moe, cfg, x):
    logits = x @ moe.gate.weight[...].T
    w, e = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
    return (w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w), e


def test_gather_and_grouped_paths_agree(monkeypatch):
    cfg, moe, rng = make_moe()
    gather = jax.jit(lambda x, e, w: moe._routed_gather(x, e, w))  # jitted: eager op-by-op is slower
    grouped = jax.jit(lambda x, e, w: moe._routed_grouped(x, e, w))
    for t in (1, 5, 40):  # 40 tokens: 120 pairs on 16 experts, still the gather path
        x = jnp.asarray(rng.normal(size=(t, cfg.hidden_size)), jnp.float32)
        w, e = route(moe, cfg, x)
        a = gather(x, e, w)
        b = grouped(x, e, w)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        full = jax.jit(lambda x: moe(x))(x)  # the dispatching call takes the gather path here
        np.testing.assert_allclose(np.asarray(full), np.asarray(b), rtol=1e-5, atol=1e-6)
    # Above the bound the dispatching call takes the grouped GEMM.
    monkeypatch.setattr(mlp, "GATHER_MAX_TOKENS", 4)
    called = []
    monkeypatch.setattr(SparseMoE, "_routed_grouped", lambda self, *a: called.append(1) or b)
    moe(x[:5])
    assert called


def test_kernel_path_in_the_model():
    # The expert-tiled kernels (interpret mode) inside SparseMoE, with experts shared across tiles.
    cfg, moe, rng = make_moe()
    x = jnp.asarray(rng.normal(size=(24, cfg.hidden_size)), jnp.float32)
    w, e = route(moe, cfg, x)
    expected = moe._routed_grouped(x, e, w)
    with dispatch.use_backend("interpret"):
        out = jax.jit(lambda x, e, w: moe._routed_gather(x, e, w))(x, e, w)
    np.testing.assert_allclose(np.asarray(out), np.asarray(expected), rtol=1e-5, atol=1e-5)
