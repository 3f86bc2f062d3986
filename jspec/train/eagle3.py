"""EAGLE3 drafter training against a frozen target, and export in the published EAGLE3 format.

The drafter is jspec's own `Eagle3Drafter` (the module the engine drafts with); training runs it
densely, unrolled over `ttt_steps` draft steps as the engine chains them (`ttt`).
Its inputs are the residual streams entering the target's capture layers (SGLang's default
layers, written to config.json so the engine captures the same ones) and the target's embedding;
its head predicts over a draft vocabulary: the corpus's most frequent target tokens, mapped back
with `d2t` (draft id + d2t[id] = target id) and marked in `t2d`, as EAGLE3 checkpoints store
them. The target runs inside the jitted step, its parameters outside the optimizer.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.models import Model, load_model
from jspec.models.causal_lm import CausalLM
from jspec.models.drafters import EAGLE3_ARCHITECTURES, Eagle3Drafter, eagle3_capture_layers, random_drafter
from jspec.train import data
from jspec.train.export import file_mib, hf_tensors, np_dtype, write_drafter
from jspec.train.frozen_target import captured_features, merged, target_fn_for
from jspec.train.history import run_meta, save_history
from jspec.train.init import num_parameters
from jspec.train.loop import TrainConfig, fit, stderr_log
from jspec.train.ttt import step_positions, step_tokens, ttt_objective, ttt_self_attention

ARCHITECTURE = EAGLE3_ARCHITECTURES[0]  # "LlamaForCausalLMEagle3", as SpecForge and SGLang write it


# ----------------------------------------------------------------------------- draft vocabulary
def draft_vocab_ids(tokens: np.ndarray, size: int, vocab_size: int) -> np.ndarray:
    """The `size` most frequent ids of a token corpus (ties and unseen ids by id), ascending:
    the target ids of the draft vocabulary."""
    if not 0 < size <= vocab_size:
        raise ValueError(f"draft vocabulary of {size} must be in [1, {vocab_size}]")
    counts = np.zeros(vocab_size, np.int64)
    step = 1 << 24  # bincount a memory-mapped corpus a slice at a time
    for s in range(0, tokens.shape[0], step):
        counts += np.bincount(np.asarray(tokens[s:s + step], np.int64), minlength=vocab_size)[:vocab_size]
    order = np.lexsort((np.arange(vocab_size), -counts))  # by count descending, then id
    return np.sort(order[:size]).astype(np.int32)


def default_aux_layer_ids(num_target_layers: int) -> list[int]:
    """SGLang's default capture layers in config.json's convention (the layer whose output is
    read, i.e. the entering stream's index minus one)."""
    return [i - 1 for i in eagle3_capture_layers({}, num_target_layers)]


# ----------------------------------------------------------------------------- model
def init_eagle3(target: Model, hot_ids: np.ndarray, *, aux_layer_ids=None, seed: int = 0, head_from_target=True,
                **shape) -> Eagle3Drafter:
    """A fresh float32 EAGLE3 head for `target` over the draft vocabulary `hot_ids`.

    shape: intermediate_size, num_attention_heads, num_key_value_heads, head_dim (default the
    target's). head_from_target: start lm_head from the target's output rows of the draft
    vocabulary and the final norm from the target's, so the head begins as the target's own
    readout and training shapes the hidden it reads."""
    tcfg = target.config
    hot_ids = np.asarray(hot_ids, np.int32)
    ids = default_aux_layer_ids(tcfg.num_hidden_layers) if aux_layer_ids is None else list(aux_layer_ids)
    dm = random_drafter("EAGLE3", target, "float32", seed=seed, draft_vocab_size=len(hot_ids), aux_layer_ids=ids,
                        **shape)
    module = dm.module()
    if module.d2t is not None:
        module.d2t[...] = jnp.asarray(hot_ids - np.arange(len(hot_ids)), jnp.int32)
    elif not np.array_equal(hot_ids, np.arange(tcfg.vocab_size)):
        raise ValueError("a full draft vocabulary must be the target's ids in order")
    if head_from_target:
        t = target.module()
        head = t.model.embed_tokens.weight if t.lm_head is None else t.lm_head.weight
        module.lm_head.weight[...] = jnp.asarray(head[...], jnp.float32)[jnp.asarray(hot_ids)]
        w = jnp.array(t.model.norm.weight[...], jnp.float32, copy=True)  # never the target's own buffer
        module.norm.weight[...] = 1.0 + w if tcfg.zero_centred_norm else w
    return module


def eagle3_unrolled(drafter: Eagle3Drafter, target: CausalLM, window, features, num_steps: int) -> list[tuple]:
    """The drafter unrolled densely: [(logits `[B, T, Vd]` float32, hidden `[B, T, E]`)] per step.

    window `[B, T+1]` token ids; features `[B, T, n*E]`: the target's captured streams over the
    first T tokens. Step 0 at row p reads the token at p + 1 and fc(features[p]) (the engine's
    catch-up); step i reads the token at o + i + 1 and step i - 1's output at row o (draft step i
    of a chain started at o). Matches the paged `Eagle3Drafter.__call__` step for step."""
    cfg, layer = drafter.config, drafter.midlayer
    t = window.shape[1] - 1
    kv, outs, h = [], [], None
    for i in range(num_steps):
        emb = drafter._embed(step_tokens(window, i), target)  # [B, T, E]
        h = drafter.fc(features.astype(emb.dtype)) if i == 0 else h.astype(emb.dtype)
        x = jnp.concatenate([layer.input_layernorm(emb), layer.hidden_norm(h)], axis=-1)  # [B, T, 2E]
        r = h + ttt_self_attention(layer.self_attn, x, step_positions(t, i), cfg.rope, kv)
        s = r + layer.mlp(layer.post_attention_layernorm(r))
        normed = drafter.norm(s)
        logits = target.compute_logits(normed) if drafter.lm_head is None else drafter.lm_head(normed)
        outs.append((logits.astype(jnp.float32), s))
        h = s
    return outs


def make_loss(target_graphdef, drafter_graphdef, capture_layers, *, num_steps: int, step_weight: float,
              compute_dtype, target_fn=None):
    """loss_fn(params, frozen, window) for `loop.make_steps`. frozen: {"target": target
    parameters, "rest": the drafter's non-trained state (d2t), "hot_ids": `[Vd]` or None}."""
    target_fn = target_fn_for(TrainConfig()) if target_fn is None else target_fn
    capture_layers = tuple(capture_layers)

    def loss_fn(params, frozen, window):
        target, drafter = merged(target_graphdef, drafter_graphdef, params, frozen, compute_dtype)
        logits, features = captured_features(target_fn, target, window, capture_layers)
        outs = eagle3_unrolled(drafter, target, window, features, num_steps)
        return ttt_objective([lg for lg, _ in outs], logits, hot_ids=frozen["hot_ids"], step_weight=step_weight)

    return loss_fn


# ----------------------------------------------------------------------------- export
def eagle3_config(drafter: Eagle3Drafter, aux_layer_ids, dtype: str) -> dict:
    """config.json of the published EAGLE3 format (a one-layer Llama plus `eagle_config`)."""
    cfg = drafter.config
    rope = cfg.rope
    raw = dict(
        architectures=[ARCHITECTURE], model_type="llama", hidden_size=cfg.hidden_size,
        intermediate_size=cfg.intermediate_size, num_hidden_layers=1, num_attention_heads=cfg.num_attention_heads,
        num_key_value_heads=cfg.num_key_value_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        draft_vocab_size=drafter.draft_vocab_size, target_hidden_size=cfg.hidden_size,
        rms_norm_eps=cfg.rms_norm_eps, max_position_embeddings=cfg.max_position_embeddings, hidden_act="silu",
        tie_word_embeddings=False, attention_bias=False, mlp_bias=False, bias=False, torch_dtype=dtype,
        rope_theta=rope.theta,
        eagle_config={"eagle_aux_hidden_state_layer_ids": [int(i) for i in aux_layer_ids],
                      "use_aux_hidden_state": True},
    )
    if rope.scaling == "llama3":
        raw["rope_scaling"] = dict(rope_type="llama3", factor=rope.factor, low_freq_factor=rope.low_freq_factor,
                                   high_freq_factor=rope.high_freq_factor,
                                   original_max_position_embeddings=rope.original_max_position_embeddings)
    return raw


def export_eagle3(drafter: Eagle3Drafter, out_dir: str, *, dtype: str = "bfloat16") -> dict:
    """Write config.json + model.safetensors in the EAGLE3 format `load_drafter("EAGLE3", ...)`
    (and SGLang) read: HF names without `model.`, no embed_tokens (the target's is used), lm_head
    over the draft vocabulary, `d2t` int64 and `t2d` bool when it is reduced. Returns the config."""
    aux_ids = [c - 1 for c in drafter.capture_layers]
    _, params, _ = nnx.split(drafter, nnx.Param, ...)
    tensors = hf_tensors(params, drafter.config, np_dtype(dtype))
    vocab, vd = drafter.config.vocab_size, drafter.draft_vocab_size
    if drafter.d2t is not None:
        d2t = np.asarray(drafter.d2t[...], np.int64)
        t2d = np.zeros(vocab, bool)
        t2d[np.arange(vd) + d2t] = True
        tensors.update(d2t=d2t, t2d=t2d)
    raw = eagle3_config(drafter, aux_ids, dtype)
    write_drafter(out_dir, tensors, raw)
    return raw


# ----------------------------------------------------------------------------- the run
def train_eagle3(target_dir: str, corpus: str, heldout: str | None, out_dir: str, cfg: TrainConfig, *,
                 draft_vocab: int = 2048, aux_layer_ids=None, head_from_target: bool = True,
                 export_dtype: str = "bfloat16", compiler_options=None, log=stderr_log, **shape) -> dict:
    """Train an EAGLE3 head for the target at `target_dir` on token files (`jspec train corpus`
    output) and export it to `out_dir`, with `eagle3_history.{json,png}`. Returns a summary."""
    target = load_model(target_dir, dtype=cfg.dtype().name)
    tokens = data.load_tokens(corpus)
    hot = draft_vocab_ids(tokens, min(draft_vocab, target.config.vocab_size), target.config.vocab_size)
    drafter = init_eagle3(target, hot, aux_layer_ids=aux_layer_ids, seed=cfg.seed,
                          head_from_target=head_from_target, **shape)
    graphdef, params, rest = nnx.split(drafter, nnx.Param, ...)
    n_params = num_parameters(params)
    log(f"EAGLE3 head: {n_params:,} parameters, capture layers {drafter.capture_layers}, draft vocabulary "
        f"{len(hot)} of {target.config.vocab_size} ({_coverage(tokens, hot):.1%} of corpus tokens)")

    loss_fn = make_loss(target.graphdef, graphdef, drafter.capture_layers, num_steps=cfg.ttt_steps,
                        step_weight=cfg.step_weight, compute_dtype=cfg.dtype(), target_fn=target_fn_for(cfg))
    frozen = {"target": target.params, "rest": rest, "hot_ids": None if drafter.d2t is None else jnp.asarray(hot)}
    params, history, timing = fit(loss_fn, params, frozen, tokens, heldout, cfg, compiler_options=compiler_options,
                                  log=log)

    trained = nnx.merge(graphdef, params, rest)
    raw = export_eagle3(trained, out_dir, dtype=export_dtype)
    size = file_mib(os.path.join(out_dir, "model.safetensors"))
    meta = run_meta("eagle3", target_dir, corpus, heldout, cfg, history, timing, draft_vocab=len(hot),
                    num_parameters=n_params, capture_layers=list(drafter.capture_layers), safetensors_mib=size)
    paths = save_history(history, out_dir, "eagle3", meta=meta)
    log(f"wrote {out_dir} (model.safetensors {size:.2f} MiB, {export_dtype}); history {paths['json']}")
    return {**meta, "paths": paths, "config_json": raw, "drafter": trained}


def _coverage(tokens: np.ndarray, hot: np.ndarray) -> float:
    """Share of a (sample of the) corpus's tokens inside the draft vocabulary."""
    sample = np.asarray(tokens[: 1 << 22])
    return float(np.isin(sample, hot).mean()) if sample.size else 0.0
