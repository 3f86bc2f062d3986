"""DFlash drafter training against a frozen target (`jspec train dflash`).

Each training window `[B, T+1]` gets K random blocks per row. Block k starts at anchor a_k (the
"newest token" of inference) and holds [token at a_k, mask x (bs - 1)] at positions a_k ..
a_k + bs - 1; it sees the context of positions < a_k (the drafter's K/V of the target's captured
streams there) and every token of its own block, nothing else: the mask the engine's paged path
applies at inference (`DFlashDrafter.__call__` after `write_context`), here dense, so all K
blocks of a row train in one forward. Block position j >= 1 is scored against the target's
distribution for the token at a_k + j (target row a_k + j - 1), forward KL as for EAGLE3, with
weight exp(-(j - 1) / decay): early positions decide how much of a block is accepted.

The exported checkpoint is z-lab's format, which the engine's DFLASH loader (`load_drafter`) reads
for `speculative_algorithm="DFLASH"`.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.models import load_model
from jspec.models.causal_lm import CausalLM
from jspec.models.drafters import DFlashDrafter, default_target_layer_ids, random_drafter
from jspec.models.rope import rope_cos_sin
from jspec.train import data
from jspec.train.export import file_mib, hf_tensors, np_dtype, write_drafter
from jspec.train.frozen_target import captured_features, merged, target_fn_for
from jspec.train.history import run_meta, save_history
from jspec.train.init import num_parameters
from jspec.train.loop import TrainConfig, fit, stderr_log

ARCHITECTURE = "DFlashDraftModel"


def init_dflash(target, *, block_size: int, mask_token_id: int, num_layers: int = 2, target_layer_ids=None,
                seed: int = 0, **shape) -> DFlashDrafter:
    """A fresh float32 DFlash drafter for `target` (a loaded `Model`); its final norm starts as
    the target's, since its output goes through the target's lm_head."""
    dm = random_drafter("DFLASH", target, "float32", seed=seed, block_size=block_size, mask_token_id=mask_token_id,
                        num_layers=num_layers, target_layer_ids=target_layer_ids, **shape)
    module = dm.module()
    w = jnp.array(target.module().model.norm.weight[...], jnp.float32, copy=True)
    module.norm.weight[...] = 1.0 + w if target.config.zero_centred_norm else w
    return module


def anchors(key, batch: int, seq_len: int, num_blocks: int, block_size: int):
    """`[B, K]` block starts in [1, T - bs + 1], so every block has context and its labels (up to
    a + bs - 1 <= T) lie in the window."""
    return jax.random.randint(key, (batch, num_blocks), 1, seq_len - block_size + 2)


def dflash_blocks(drafter: DFlashDrafter, target: CausalLM, window, features, starts):
    """Block logits `[B, K, bs, V]` float32 of the dense DFlash forward.

    window `[B, T+1]`; features `[B, T, n*E]`: the target's captured streams over the first T
    tokens; starts `[B, K]` block anchors."""
    b, t = window.shape[0], window.shape[1] - 1
    k_blocks, bs = starts.shape[1], drafter.block_size
    cfg = drafter.config
    e = cfg.hidden_size
    c = drafter.hidden_norm(drafter.fc(features.astype(drafter.fc.weight[...].dtype)))  # [B, T, E]
    ctx_cos_sin = rope_cos_sin(cfg.rope, jnp.tile(jnp.arange(t, dtype=jnp.int32), b))
    pos = starts[:, :, None] + jnp.arange(bs, dtype=jnp.int32)  # [B, K, bs]
    first = jnp.take_along_axis(window, starts, axis=1)  # [B, K]
    ids = jnp.concatenate([first[..., None], jnp.full((b, k_blocks, bs - 1), drafter.mask_token_id, jnp.int32)], -1)
    x = target.model.embed_tokens(ids.reshape(b * k_blocks * bs)).astype(c.dtype)  # [B*K*bs, E]
    blk_cos_sin = rope_cos_sin(cfg.rope, pos.reshape(-1))
    # Who sees what: context position s < a_k, and the keys of the same block.
    ctx_ok = jnp.arange(t)[None, None, :] < starts[:, :, None]  # [B, K, T]
    ctx_ok = jnp.repeat(ctx_ok, bs, axis=1)  # [B, K*bs, T]
    blk = jnp.arange(k_blocks * bs) // bs
    blk_ok = jnp.broadcast_to(blk[:, None] == blk[None, :], (b, k_blocks * bs, k_blocks * bs))
    mask = jnp.concatenate([ctx_ok, blk_ok], axis=-1)[:, None]  # [B, 1, Q, T + K*bs]
    n = k_blocks * bs
    for layer in drafter.layers:
        attn = layer.self_attn
        kc, vc = layer.context_kv(c.reshape(b * t, e), ctx_cos_sin)
        q, kb, vb, gate = attn.project(layer.input_layernorm(x), blk_cos_sin)
        g, d = attn.num_kv_heads, attn.head_dim
        k = jnp.concatenate([kc.reshape(b, t, g, d), kb.reshape(b, n, g, d)], axis=1)
        v = jnp.concatenate([vc.reshape(b, t, g, d), vb.reshape(b, n, g, d)], axis=1)
        o = jax.nn.dot_product_attention(q.reshape(b, n, attn.num_heads, d), k, v, mask=mask, scale=d ** -0.5)
        x = x + attn.output(o.reshape(b * n, attn.num_heads, d), gate)
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    logits = target.compute_logits(drafter.norm(x))
    return logits.reshape(b, k_blocks, bs, -1)


def block_objective(block_logits, target_logits, starts, *, decay: float):
    """Forward KL from the target to the drafter at every block position j >= 1 (the target's
    row a + j - 1 predicts the token there), weighted exp(-(j-1)/decay); metrics acc_{j-1}: the
    drafter's argmax equals the target's."""
    b, k_blocks, bs, _ = block_logits.shape
    rows = starts[:, :, None] + jnp.arange(bs - 1)  # [B, K, bs-1]: target rows for positions 1..bs-1
    tl = jnp.take_along_axis(target_logits, rows.reshape(b, -1)[..., None], axis=1)
    tl = tl.reshape(b, k_blocks, bs - 1, -1).astype(jnp.float32)
    dl = block_logits[:, :, 1:].astype(jnp.float32)
    logp = jax.nn.log_softmax(tl, axis=-1)
    kl = jnp.sum(jnp.exp(logp) * (logp - jax.nn.log_softmax(dl, axis=-1)), axis=-1)  # [B, K, bs-1]
    hit = (jnp.argmax(dl, -1) == jnp.argmax(tl, -1)).astype(jnp.float32)
    w = jnp.exp(-jnp.arange(bs - 1, dtype=jnp.float32) / decay)
    per_pos = jnp.mean(kl, axis=(0, 1))
    loss = jnp.sum(w * per_pos) / jnp.sum(w)
    accs = jnp.mean(hit, axis=(0, 1))
    metrics = {f"acc_{j}": accs[j] for j in range(bs - 1)}
    metrics.update({f"loss_{j}": per_pos[j] for j in range(bs - 1)})
    return loss, metrics


def make_loss(target_graphdef, drafter_graphdef, capture_layers, *, num_blocks: int, decay: float, compute_dtype,
              target_fn=None, seed: int = 0):
    """loss_fn(params, frozen, window) for `loop.fit`. The anchors are drawn from the
    window's own ids (a hash of them), so a jitted step needs no key argument and evaluation on
    fixed windows is deterministic."""
    target_fn = target_fn_for(TrainConfig()) if target_fn is None else target_fn
    capture_layers = tuple(capture_layers)

    def loss_fn(params, frozen, window):
        target, drafter = merged(target_graphdef, drafter_graphdef, params, frozen, compute_dtype)
        logits, features = captured_features(target_fn, target, window, capture_layers)
        b, t = features.shape[:2]
        key = jax.random.fold_in(jax.random.PRNGKey(seed), jnp.sum(window[:, :8] * jnp.arange(1, 9)).astype(jnp.int32))
        starts = anchors(key, b, t, num_blocks, drafter.block_size)
        blocks = dflash_blocks(drafter, target, window, features, starts)
        return block_objective(blocks, logits, starts, decay=decay)

    return loss_fn


def dflash_config(drafter: DFlashDrafter, num_target_layers: int, dtype: str) -> dict:
    """config.json of z-lab's DFlash format (a Qwen3-shaped drafter plus `dflash_config`)."""
    cfg = drafter.config
    return dict(
        architectures=[ARCHITECTURE], model_type="qwen3", hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=cfg.num_hidden_layers,
        num_attention_heads=cfg.num_attention_heads, num_key_value_heads=cfg.num_key_value_heads,
        head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, rms_norm_eps=cfg.rms_norm_eps,
        rope_theta=cfg.rope.theta, max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
        attention_bias=False, tie_word_embeddings=False, torch_dtype=dtype, block_size=drafter.block_size,
        num_target_layers=num_target_layers,
        dflash_config={"mask_token_id": int(drafter.mask_token_id),
                       "target_layer_ids": [int(c) - 1 for c in drafter.capture_layers]},
    )


def export_dflash(drafter: DFlashDrafter, out_dir: str, num_target_layers: int, *, dtype: str = "bfloat16") -> dict:
    """Write config.json + model.safetensors for `load_drafter("DFLASH", ...)`; returns the config."""
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    raw = dflash_config(drafter, num_target_layers, dtype)
    write_drafter(out_dir, hf_tensors(params, drafter.config, np_dtype(dtype)), raw)
    return raw


def train_dflash(target_dir: str, corpus: str, heldout: str | None, out_dir: str, cfg: TrainConfig, *,
                 block_size: int = 8, num_layers: int = 2, num_blocks: int = 8, decay: float | None = None,
                 target_layer_ids=None, mask_token_id: int | None = None, export_dtype: str = "bfloat16",
                 compiler_options=None, log=stderr_log, **shape) -> dict:
    """Train a DFlash drafter for the target at `target_dir` and export it to `out_dir`, with
    `dflash_history.{json,png}`. mask_token_id: default the tokenizer's `<|mask|>`, else the last id."""
    target = load_model(target_dir, dtype=cfg.dtype().name)
    if mask_token_id is None:
        tok = target.tokenizer
        mask_token_id = tok.token_to_id("<|mask|>") if tok is not None else None
        mask_token_id = target.config.vocab_size - 1 if mask_token_id is None else mask_token_id
    ids = target_layer_ids or sorted({min(max(i, 0), target.config.num_hidden_layers - 2)
                                      for i in default_target_layer_ids(target.config.num_hidden_layers, num_layers)})
    drafter = init_dflash(target, block_size=block_size, mask_token_id=mask_token_id, num_layers=num_layers,
                          target_layer_ids=ids, seed=cfg.seed, **shape)
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    n_params = num_parameters(params)
    log(f"DFlash drafter: {n_params:,} parameters, {num_layers} layers, block {block_size}, reads target layers {ids}, "
        f"mask token {mask_token_id}")
    cfg = TrainConfig(**{**cfg.__dict__, "ttt_steps": block_size - 1})  # one accuracy per block position
    loss_fn = make_loss(target.graphdef, graphdef, drafter.capture_layers, num_blocks=num_blocks,
                        decay=decay or block_size / 2, compute_dtype=cfg.dtype(), target_fn=target_fn_for(cfg),
                        seed=cfg.seed)
    frozen = {"target": target.params, "rest": rest}
    params, history, timing = fit(loss_fn, params, frozen, data.load_tokens(corpus), heldout, cfg,
                                  compiler_options=compiler_options, log=log)
    trained = nnx.merge(graphdef, params, rest)
    raw = export_dflash(trained, out_dir, target.config.num_hidden_layers, dtype=export_dtype)
    size = file_mib(os.path.join(out_dir, "model.safetensors"))
    meta = run_meta("dflash", target_dir, corpus, heldout, cfg, history, timing, num_parameters=n_params,
                    block_size=block_size, num_blocks=num_blocks, target_layer_ids=list(ids), safetensors_mib=size)
    paths = save_history(history, out_dir, "dflash", meta=meta)
    log(f"wrote {out_dir} (model.safetensors {size:.2f} MiB, {export_dtype}); history {paths['json']}")
    return {**meta, "paths": paths, "config_json": raw, "drafter": trained}
