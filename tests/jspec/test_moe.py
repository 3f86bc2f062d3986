"""The two routed-expert paths of SparseMoE (gather for few tokens, grouped GEMM for many) agree."""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.config import parse_hf_config
from jspec.models.mlp import SparseMoE
from jspec.models.presets import preset_config


def test_gather_and_grouped_paths_agree():
    cfg = parse_hf_config(dict(preset_config("tiny-qwen3-moe"), num_experts=16, num_experts_per_tok=3))
    moe = SparseMoE(cfg, dtype=jnp.float32)
    rng = np.random.default_rng(0)
    for path, leaf in nnx.state(moe).flat_state():
        leaf.set_value(jnp.asarray(rng.normal(0, 0.1, leaf.get_value().shape), jnp.float32))
    for t in (1, 2, 5):  # t * 3 <= 8 takes the gather path in __call__
        x = jnp.asarray(rng.normal(size=(t, cfg.hidden_size)), jnp.float32)
        logits = x @ moe.gate.weight[...].T
        w, e = jax.lax.top_k(jax.nn.softmax(logits, axis=-1), cfg.num_experts_per_tok)
        w = w / w.sum(-1, keepdims=True) if cfg.norm_topk_prob else w
        a = moe._routed_gather(x, e, w)
        b = moe._routed_grouped(x, e, w)
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-6)
        full = moe(x)  # the dispatching call takes the gather path here
        np.testing.assert_allclose(np.asarray(full), np.asarray(b), rtol=1e-5, atol=1e-6)
