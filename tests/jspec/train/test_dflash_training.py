"""DFlash drafter training: the dense multi-block forward against the engine's paged path (context
written to pages, then one block, per block), a few optimizer steps, and the export read back by
the engine's DFLASH loader."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jspec.cache.pool import allocate_caches
from jspec.models import load_model
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.models.drafters import load_drafter
from jspec.train import dflash
from jspec.train.dense import dense_forward
from jspec.train.frozen_target import target_fn_for
from jspec.train.loop import TrainConfig, make_opt, make_steps, train_loop
from tests.support import models as tm
from tests.support.compiles import FAST

B, T, BLOCK, K = 2, 12, 4, 3


@pytest.fixture(scope="module")
def setup(tiny_checkpoint):
    d = tiny_checkpoint("qwen3", 3)
    target = load_model(d, dtype="float32")
    drafter = dflash.init_dflash(target, block_size=BLOCK, mask_token_id=tm.VOCAB - 1, num_layers=2,
                                 target_layer_ids=[0], seed=1)
    # Away from the identity init, so every parameter shows.
    _, params, rest = nnx.split(drafter, nnx.Param, ...)
    params = jax.tree_util.tree_map(
        lambda x: x + 0.05 * jax.random.normal(jax.random.PRNGKey(x.size), x.shape, x.dtype), params)
    drafter = nnx.merge(nnx.graphdef(drafter), params, rest)
    return d, target, drafter


def _paged_block(drafter, tgt, features, window, a):
    """Logits `[BLOCK, V]` of one block at anchor a through write_context + the paged block,
    jitted as the engine runs it (one compile per anchor instead of op-by-op dispatch)."""
    dgd, dstate = nnx.split(drafter)
    tgd, tstate = nnx.split(tgt)
    return np.asarray(_paged_block_jit(dgd, dstate, tgd, tstate, jnp.asarray(features), int(window[a]), a))


@functools.partial(jax.jit, static_argnums=(0, 2, 6))
def _paged_block_jit(dgd, dstate, tgd, tstate, features, first, a):
    drafter, tgt = nnx.merge(dgd, dstate), nnx.merge(tgd, tstate)
    caches = allocate_caches(drafter.config, num_pages=8, page_size=4, num_state_slots=1, dtype=jnp.float32)
    caches = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.nan), caches)
    table = jnp.asarray([[6, 1, 4, 0, 7, 2]], jnp.int32)

    def slots(pos):
        return table[0][pos // 4] * 4 + pos % 4

    pos = jnp.arange(a, dtype=jnp.int32)
    cb = ForwardBatch(input_ids=jnp.zeros((a,), jnp.int32), positions=pos, seq_lens=jnp.asarray([a]),
                      cu_q_lens=jnp.asarray([0, a]), page_table=table, slot_mapping=slots(pos),
                      state_slots=jnp.zeros((1,), jnp.int32), has_initial_state=jnp.zeros((1,), bool), mode=ForwardMode.EXTEND)
    caches = drafter.write_context(cb, caches, features[:a])
    bpos = a + jnp.arange(BLOCK, dtype=jnp.int32)
    ids = jnp.concatenate([jnp.reshape(first, (1,)).astype(jnp.int32),
                           jnp.full((BLOCK - 1,), drafter.mask_token_id, jnp.int32)])
    bb = ForwardBatch(input_ids=ids, positions=bpos, seq_lens=jnp.asarray([a + BLOCK]),
                      cu_q_lens=jnp.asarray([0, BLOCK]), page_table=table, slot_mapping=slots(bpos),
                      state_slots=jnp.zeros((1,), jnp.int32), has_initial_state=jnp.ones((1,), bool),
                      tree_mask=jnp.ones((1, BLOCK, BLOCK), bool), mode=ForwardMode.VERIFY)
    out, _ = drafter(bb, caches, target=tgt)
    return out.logits


def test_dense_blocks_equal_engine_path(setup):
    _, target, drafter = setup
    tgt = target.module()
    window = np.random.default_rng(0).integers(0, tm.VOCAB - 1, size=(B, T + 1)).astype(np.int32)
    _, _, aux = dense_forward(tgt, jnp.asarray(window[:, :-1]), capture_layers=drafter.capture_layers)
    feats = aux.reshape(B, T, -1)
    starts = jnp.asarray([[1, 5, T - BLOCK + 1], [3, 3, 8]], jnp.int32)  # a repeated anchor too
    dense = np.asarray(dflash.dflash_blocks(drafter, tgt, jnp.asarray(window), feats, starts))
    for b in range(B):
        for k in range(K):
            ref = _paged_block(drafter, tgt, feats[b], window[b], int(starts[b, k]))
            err = tm.rel_err(dense[b, k], ref)
            assert err < 1e-4, (b, k, err)


def test_training_lowers_loss_and_exports(setup, tmp_path):
    d, target, drafter = setup
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    cfg = TrainConfig(steps=12, batch_size=B, seq_len=T, ttt_steps=BLOCK - 1, lr=3e-3, warmup_steps=1,
                      log_every=4, eval_every=100, compute_dtype="float32", attention_impl="xla")
    loss_fn = dflash.make_loss(target.graphdef, graphdef, drafter.capture_layers, num_blocks=K, decay=2.0,
                               compute_dtype=jnp.float32, target_fn=target_fn_for(cfg))
    frozen = {"target": target.params, "rest": rest}
    window = np.random.default_rng(1).integers(0, tm.VOCAB - 1, size=(B, T + 1)).astype(np.int32)
    train_step, eval_step = make_steps(loss_fn, make_opt(cfg), FAST)
    before = float(eval_step(params, frozen, jnp.asarray(window))["loss"])
    params, _, _ = train_loop(train_step, eval_step, params, make_opt(cfg).init(params), frozen,
                              iter([window] * cfg.steps), cfg, log=lambda m: None)
    after = float(eval_step(params, frozen, jnp.asarray(window))["loss"])
    assert after < 0.7 * before, (before, after)

    trained = nnx.merge(graphdef, params, rest)
    out = str(tmp_path / "dflash")
    raw = dflash.export_dflash(trained, out, target.config.num_hidden_layers, dtype="float32")
    assert raw["dflash_config"]["target_layer_ids"] == [0] and raw["block_size"] == BLOCK
    dm = load_drafter("DFLASH", out, target)
    loaded = dm.module()
    tgt = target.module()
    _, _, aux = dense_forward(tgt, jnp.asarray(window[:, :-1]), capture_layers=dm.capture_layers)
    starts = jnp.asarray([[2, 6, 9], [1, 4, 7]], jnp.int32)
    a = dflash.dflash_blocks(trained, tgt, jnp.asarray(window), aux.reshape(B, T, -1), starts)
    b = dflash.dflash_blocks(loaded, tgt, jnp.asarray(window), aux.reshape(B, T, -1), starts)
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
