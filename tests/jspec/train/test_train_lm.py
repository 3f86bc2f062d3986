"""A few training steps lower the loss; the exported HF checkpoint (sharded) loads into jspec and
transformers with the trained model's logits."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.safetensors_reader import INDEX_FILE
from jspec.config import parse_hf_config
from jspec.models import load_model
from jspec.train import optim
from jspec.train.dense import dense_forward
from jspec.train.export import export_hf
from jspec.train.init import init_params
from jspec.train.lm import make_steps
from tests.support.models import rel_err

VOCAB = 96
TINY_NEXT = dict(
    architectures=["Qwen3NextForCausalLM"], model_type="qwen3_next", vocab_size=VOCAB, hidden_size=32,
    intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
    full_attention_interval=2, linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
    linear_value_head_dim=16, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
    moe_intermediate_size=32, shared_expert_intermediate_size=32, norm_topk_prob=True, partial_rotary_factor=0.5,
    tie_word_embeddings=True, num_nextn_predict_layers=1, rms_norm_eps=1e-6, eos_token_id=[0, 1], pad_token_id=0,
)


@pytest.fixture(scope="module")
def trained():
    config = parse_hf_config(TINY_NEXT)
    graphdef, params = init_params(config, seed=0)
    opt = optim.adamw(weight_decay=0.0)
    opt_state = opt.init(params)
    train_step, eval_step = make_steps(graphdef, opt, compute_dtype=jnp.float32, attention_impl=None)
    batch = jnp.asarray(np.random.default_rng(0).integers(0, VOCAB, (2, 41)), jnp.int32)
    losses = []
    for _ in range(12):
        params, opt_state, m = train_step(params, opt_state, batch, jnp.asarray(1e-2, jnp.float32))
        losses.append(float(m["loss"]))
    return graphdef, params, losses, float(eval_step(params, batch)) / batch[:, 1:].size


def test_loss_goes_down(trained):
    _, _, losses, final = trained
    assert losses[0] == pytest.approx(np.log(VOCAB), abs=0.3)  # a fresh model is close to uniform
    assert losses[-1] < 0.8 * losses[0] and final < losses[-1]
    assert all(np.isfinite(losses))


def test_lr_schedule():
    lrs = [optim.lr_at(s, peak=1.0, warmup=10, total=100, min_ratio=0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(0.1) and lrs[9] == pytest.approx(1.0)
    assert lrs[99] == pytest.approx(0.1, abs=1e-3) and all(a >= b for a, b in zip(lrs[9:], lrs[10:]))


def test_export_sharded_loads_in_jspec_and_transformers(trained, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    graphdef, params, _, _ = trained
    d = str(tmp_path / "fp32")
    limit = 40_000
    files = export_hf(params, TINY_NEXT, d, dtype="float32", max_shard_bytes=limit, card="# tiny\n")
    shards = [f for f in files if f.endswith(".safetensors")]
    assert len(shards) > 1 and INDEX_FILE in files and "README.md" in files
    assert all(os.path.getsize(os.path.join(d, f)) <= limit for f in shards)
    with open(os.path.join(d, INDEX_FILE)) as f:
        assert set(json.load(f)["weight_map"].values()) == set(shards)

    ids = np.random.default_rng(1).integers(0, VOCAB, 37)
    module = nnx.merge(graphdef, params)
    want = np.asarray(jax.jit(lambda x: dense_forward(module, x)[0])(jnp.asarray(ids[None])))[0]
    got = load_model(d, dtype="float32").score(ids)
    assert rel_err(got, want) < 1e-4
    hf = AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    with torch.no_grad():
        hf_logits = hf(torch.tensor(ids[None])).logits[0].numpy()
    assert rel_err(hf_logits, want) < 1e-4

    # Default export: bfloat16, one file at this size.
    d16 = str(tmp_path / "bf16")
    files = export_hf(params, TINY_NEXT, d16)
    assert "model.safetensors" in files and INDEX_FILE not in files
    with open(os.path.join(d16, "config.json")) as f:
        assert json.load(f)["dtype"] == "bfloat16"
    m16 = load_model(d16, dtype="float32")
    assert m16.num_parameters() == load_model(d, dtype="float32").num_parameters()
    assert rel_err(m16.score(ids), want) < 0.05
