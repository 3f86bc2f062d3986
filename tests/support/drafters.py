"""Tiny random drafter checkpoints in their published formats, for a tiny target of support.models.

- `write_eagle`: an EAGLE (v1 / v2) head directory (config.json + model.safetensors, no `model.`
  prefix unless asked);
- `write_eagle3`: an EAGLE3 head directory (midlayer, norm, lm_head over a draft vocabulary, d2t /
  t2d, aux-layer ids in `eagle_config`);
- `write_dflash`: a DFlash block drafter directory (z-lab's format: Qwen3 layers, fc,
  hidden_norm, norm, `block_size` and `dflash_config` in config.json);
- `add_mtp`: `mtp.*` tensors appended as an extra shard to a Qwen3-Next / Qwen3.5 target
  directory, named like the target's own full-attention layer.

Every weight is random and every norm weight perturbed away from its identity value, so the norm
conventions (w vs 1 + w) and which norm applies where all show in the outputs. The drafter's
attention shape, eps and RoPE theta differ from the target's, so a head that borrowed the target's
config would show too.
"""

from __future__ import annotations

import json
import os
import re

import numpy as np

MTP_SHARD = "model-mtp.safetensors"
INDEX = "model.safetensors.index.json"


def target_config(target_dir: str) -> dict:
    """The target's text-model config.json fields (a multimodal wrapper's text_config merged in)."""
    with open(os.path.join(target_dir, "config.json")) as f:
        cfg = json.load(f)
    return {**cfg, **cfg["text_config"]} if isinstance(cfg.get("text_config"), dict) else cfg


def _matrix(rng, *shape):
    return (0.08 * rng.standard_normal(shape)).astype(np.float32)


def _norm(rng, n, *, zero_centred=False):
    return ((0.0 if zero_centred else 1.0) + 0.1 * rng.standard_normal(n)).astype(np.float32)


def _head_config(tc: dict, arch: str, **extra) -> dict:
    e = tc["hidden_size"]
    return dict(architectures=[arch], model_type="llama", hidden_size=e, intermediate_size=80, num_hidden_layers=1,
                num_attention_heads=4, num_key_value_heads=2, head_dim=e // 4, vocab_size=tc["vocab_size"],
                rms_norm_eps=1e-5, rope_theta=5000.0, max_position_embeddings=256, hidden_act="silu",
                tie_word_embeddings=False, torch_dtype="float32", **extra)


def _attention_mlp(rng, cfg: dict, pre: str, in_width: int) -> dict:
    e, h, g, d, i = (cfg[k] for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                      "intermediate_size"))
    return {
        f"{pre}.self_attn.q_proj.weight": _matrix(rng, h * d, in_width),
        f"{pre}.self_attn.k_proj.weight": _matrix(rng, g * d, in_width),
        f"{pre}.self_attn.v_proj.weight": _matrix(rng, g * d, in_width),
        f"{pre}.self_attn.o_proj.weight": _matrix(rng, e, h * d),
        f"{pre}.post_attention_layernorm.weight": _norm(rng, e),
        f"{pre}.mlp.gate_proj.weight": _matrix(rng, i, e),
        f"{pre}.mlp.up_proj.weight": _matrix(rng, i, e),
        f"{pre}.mlp.down_proj.weight": _matrix(rng, e, i),
    }


def _save(out_dir: str, cfg: dict, tensors: dict) -> None:
    from safetensors.numpy import save_file

    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"))


def write_eagle(out_dir: str, target_dir: str, seed: int = 0, *, embed: bool = True, bias: bool = True,
                prefix: str = "") -> dict:
    """An EAGLE head. embed: ship its own embed_tokens; bias: fc.bias (EAGLE v1); prefix: e.g.
    "model." as some writers store. Returns the config dict."""
    rng = np.random.default_rng(seed)
    tc = target_config(target_dir)
    e = tc["hidden_size"]
    cfg = _head_config(tc, "LlamaForCausalLMEagle", bias=bias)
    tensors = {"fc.weight": _matrix(rng, e, 2 * e), **_attention_mlp(rng, cfg, "layers.0", e)}
    if bias:
        tensors["fc.bias"] = _matrix(rng, e)
    if embed:
        tensors["embed_tokens.weight"] = _matrix(rng, tc["vocab_size"], e)
    _save(out_dir, cfg, {prefix + k: v for k, v in tensors.items()})
    return cfg


def write_eagle3(out_dir: str, target_dir: str, seed: int = 0, draft_vocab: int | None = None,
                 aux_layer_ids: list[int] | None = None, *, embed: bool = False) -> dict:
    """An EAGLE3 head over `draft_vocab` ids (default: the whole target vocabulary), reading the
    outputs of target layers `aux_layer_ids` (default: none written, so the loader's default).
    The hot vocabulary is a random sorted subset. Returns the config dict."""
    rng = np.random.default_rng(seed)
    tc = target_config(target_dir)
    e, vocab = tc["hidden_size"], tc["vocab_size"]
    vd = vocab if draft_vocab is None else draft_vocab
    extra = {"draft_vocab_size": vd}
    if aux_layer_ids is not None:
        extra["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": list(aux_layer_ids)}
    cfg = _head_config(tc, "LlamaForCausalLMEagle3", **extra)
    n = 3 if aux_layer_ids is None else len(aux_layer_ids)
    hot = np.sort(rng.choice(vocab, size=vd, replace=False))
    t2d = np.zeros(vocab, bool)
    t2d[hot] = True
    tensors = {
        "fc.weight": _matrix(rng, e, n * e),
        "midlayer.input_layernorm.weight": _norm(rng, e),
        "midlayer.hidden_norm.weight": _norm(rng, e),
        **_attention_mlp(rng, cfg, "midlayer", 2 * e),
        "norm.weight": _norm(rng, e),
        "lm_head.weight": _matrix(rng, vd, e),
        "d2t": (hot - np.arange(vd)).astype(np.int64),
        "t2d": t2d,
    }
    if embed:
        tensors["embed_tokens.weight"] = _matrix(rng, vocab, e)
    _save(out_dir, cfg, tensors)
    return cfg


def write_dflash(out_dir: str, target_dir: str, seed: int = 0, *, target_layer_ids: list[int], num_layers: int = 2,
                 block_size: int = 4, mask_token_id: int | None = None, prefix: str = "") -> dict:
    """A DFlash drafter of `num_layers` Qwen3 layers reading the outputs of target layers
    `target_layer_ids`. Returns the config dict."""
    rng = np.random.default_rng(seed)
    tc = target_config(target_dir)
    e, vocab = tc["hidden_size"], tc["vocab_size"]
    cfg = _head_config(tc, "DFlashDraftModel", block_size=block_size, num_target_layers=tc["num_hidden_layers"],
                       dflash_config={"mask_token_id": vocab - 1 if mask_token_id is None else mask_token_id,
                                      "target_layer_ids": list(target_layer_ids)})
    cfg.update(model_type="qwen3", num_hidden_layers=num_layers)
    tensors = {"fc.weight": _matrix(rng, e, len(target_layer_ids) * e), "hidden_norm.weight": _norm(rng, e),
               "norm.weight": _norm(rng, e)}
    d = cfg["head_dim"]
    for i in range(num_layers):
        pre = f"layers.{i}"
        tensors.update(_attention_mlp(rng, cfg, pre, e))
        tensors[f"{pre}.input_layernorm.weight"] = _norm(rng, e)
        tensors[f"{pre}.self_attn.q_norm.weight"] = _norm(rng, d)
        tensors[f"{pre}.self_attn.k_norm.weight"] = _norm(rng, d)
    _save(out_dir, cfg, {prefix + k: v for k, v in tensors.items()})
    return cfg


def _template_layer(names: list[str]) -> tuple[str, int]:
    """(decoder prefix, index) of a target full-attention layer to copy names and shapes from;
    an MoE one when the target has MoE layers (the MTP layer follows the target's blocks)."""
    attn = {}
    for n in names:
        m = re.match(r"^(.*)layers\.(\d+)\.self_attn\.q_proj\.weight$", n)
        if m:
            attn[int(m[2])] = m[1]
    moe = [i for i, p in attn.items() if f"{p}layers.{i}.mlp.gate.weight" in names]
    i = min(moe or attn)
    return attn[i], i


def add_mtp(target_dir: str, seed: int = 0) -> dict:
    """Append a random MTP layer (`mtp.*`) to a tiny Qwen3-Next / Qwen3.5 target directory, as an
    extra shard; the index (if any) and config.json (`mtp_num_hidden_layers`) are updated.
    Returns the tensors written."""
    from safetensors.numpy import save_file

    from checkpoints.safetensors_reader import SafetensorsCheckpoint

    rng = np.random.default_rng(seed)
    tc = target_config(target_dir)
    e = tc["hidden_size"]
    ckpt = SafetensorsCheckpoint(target_dir)
    names = ckpt.names()
    prefix, layer = _template_layer(names)
    tensors = {}
    src = f"{prefix}layers.{layer}."
    for n in names:
        if n.startswith(src):
            shape = ckpt.shape(n)
            # The only vectors of a full-attention layer are its norms (all zero-centred here).
            tensors["mtp.layers.0." + n[len(src):]] = (_norm(rng, shape[0], zero_centred=True) if len(shape) == 1
                                                        else _matrix(rng, *shape))
    tensors.update({
        "mtp.fc.weight": _matrix(rng, e, 2 * e),
        "mtp.pre_fc_norm_embedding.weight": _norm(rng, e, zero_centred=True),
        "mtp.pre_fc_norm_hidden.weight": _norm(rng, e, zero_centred=True),
        "mtp.norm.weight": _norm(rng, e, zero_centred=True),
    })
    ckpt.close()
    save_file(tensors, os.path.join(target_dir, MTP_SHARD))

    index = os.path.join(target_dir, INDEX)
    if os.path.exists(index):
        with open(index) as f:
            data = json.load(f)
        data["weight_map"].update({n: MTP_SHARD for n in tensors})
        with open(index, "w") as f:
            json.dump(data, f, indent=2)
    cfg_file = os.path.join(target_dir, "config.json")
    with open(cfg_file) as f:
        cfg = json.load(f)
    (cfg["text_config"] if isinstance(cfg.get("text_config"), dict) else cfg)["mtp_num_hidden_layers"] = 1
    with open(cfg_file, "w") as f:
        json.dump(cfg, f, indent=2)
    return tensors


# ----------------------------------------------------------------------------- drafters that agree
# A random drafter almost never agrees with its target, so the acceptance paths (keeping drafts,
# tree walks past depth 1, the drafter's catch-up over several accepted tokens) would go untested.
# These rewrite a tiny target so its next token depends mostly on the current token (token mixers
# scaled by `eps`, one MLP block kept), and build a drafter that computes that same function from
# the token it consumes: then most drafts are accepted, yet the context still moves the logits.


def _rewrite(target_dir: str, fn) -> None:
    """Apply fn(name, array) -> array to every tensor of a single-file target checkpoint."""
    from safetensors.numpy import load_file, save_file

    path = os.path.join(target_dir, "model.safetensors")
    tensors = load_file(path)
    save_file({k: fn(k, v) for k, v in tensors.items()}, path)


def make_near_bigram(target_dir: str, keep_mlp_layer: int, eps: float = 0.05, logit_scale: float = 1.0) -> None:
    """Token mixers' outputs x eps, every feed-forward block but layer `keep_mlp_layer`'s zeroed,
    the final norm a uniform `logit_scale` (identity by default; smaller flattens the target's
    distribution without moving its argmax), embedding rows at unit RMS (so norms before the kept
    block see the embedding unchanged)."""
    zero_centred = target_config(target_dir).get("model_type") in ("qwen3_next", "qwen3_5_text", "qwen3_5_moe_text")

    def fn(name, x):
        m = re.search(r"layers\.(\d+)\.", name)
        if name.endswith(("self_attn.o_proj.weight", "linear_attn.out_proj.weight")):
            return (x * eps).astype(x.dtype)
        if m and ".mlp." in name and "down_proj" in name and int(m[1]) != keep_mlp_layer:
            return np.zeros_like(x)
        if name.endswith("model.norm.weight"):
            return np.full_like(x, logit_scale - 1.0 if zero_centred else logit_scale)
        if name.endswith("embed_tokens.weight"):
            return (x / np.sqrt(np.mean(x.astype(np.float64) ** 2, axis=1, keepdims=True))).astype(x.dtype)
        return x

    _rewrite(target_dir, fn)


def write_agreeing_eagle(out_dir: str, target_dir: str, seed: int = 0, logit_scale: float = 1.0) -> dict:
    """An EAGLE head for `make_near_bigram(target_dir, 0, logit_scale=s)` of a Llama / Qwen3
    target: fc passes the token embedding, attention adds nothing, the MLP is the target's layer-0
    block. Its output is the target's pre-norm hidden for that token, so the shared lm_head gives
    the same argmax; both scaled by `logit_scale` (fc and the MLP's down projection; the MLP's
    input norm does not see the scale), its distribution is close to the target's too."""
    from safetensors.numpy import load_file

    cfg = write_eagle(out_dir, target_dir, seed, embed=True, bias=True)
    tgt = load_file(os.path.join(target_dir, "model.safetensors"))
    path = os.path.join(out_dir, "model.safetensors")
    heads = load_file(path)
    e = heads["fc.weight"].shape[0]
    heads["fc.weight"] = np.concatenate([logit_scale * np.eye(e), np.zeros((e, e))], axis=1).astype(np.float32)
    heads["fc.bias"] = np.zeros(e, np.float32)
    heads["embed_tokens.weight"] = tgt["model.embed_tokens.weight"]
    heads["layers.0.self_attn.o_proj.weight"] = np.zeros_like(heads["layers.0.self_attn.o_proj.weight"])
    heads["layers.0.post_attention_layernorm.weight"] = tgt["model.layers.0.post_attention_layernorm.weight"]
    for p in ("gate_proj", "up_proj", "down_proj"):
        heads[f"layers.0.mlp.{p}.weight"] = tgt[f"model.layers.0.mlp.{p}.weight"]
    heads["layers.0.mlp.down_proj.weight"] = (logit_scale * heads["layers.0.mlp.down_proj.weight"]).astype(np.float32)
    cfg["intermediate_size"] = heads["layers.0.mlp.gate_proj.weight"].shape[0]
    _save(out_dir, cfg, heads)
    return cfg


def add_agreeing_mtp(target_dir: str, seed: int = 0) -> int:
    """Make a Qwen3-Next / Qwen3.5 target near-bigram around the layer the MTP layer copies
    (returned) and add an MTP layer that agrees with it: fc passes the normed embedding (unit RMS,
    so unchanged), attention adds nothing, the MoE block and its norm are that layer's, the other
    norms at identity."""
    from safetensors.numpy import load_file, save_file

    from checkpoints.safetensors_reader import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(target_dir)
    prefix, layer = _template_layer(ckpt.names())
    ckpt.close()
    make_near_bigram(target_dir, layer)
    add_mtp(target_dir, seed)
    tgt = load_file(os.path.join(target_dir, "model.safetensors"))
    path = os.path.join(target_dir, MTP_SHARD)
    mtp = load_file(path)
    e = mtp["mtp.fc.weight"].shape[0]
    mtp["mtp.fc.weight"] = np.concatenate([np.eye(e), np.zeros((e, e))], axis=1).astype(np.float32)
    for n in ("mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight"):
        mtp[n] = np.zeros_like(mtp[n])
    mtp["mtp.layers.0.self_attn.o_proj.weight"] = np.zeros_like(mtp["mtp.layers.0.self_attn.o_proj.weight"])
    src = f"{prefix}layers.{layer}."
    for n, x in tgt.items():
        if n.startswith(src) and (".mlp." in n or "post_attention_layernorm" in n):
            mtp["mtp.layers.0." + n[len(src):]] = x
    save_file(mtp, path)
    return layer


def make_block_bigram(target_dir: str, mlp_scale: float = 100.0) -> None:
    """`make_near_bigram(target_dir, 0)` for a tied-embedding Qwen3 target with layer 0's MLP
    output x mlp_scale (so the bigram is not mostly "repeat the token"), then embedding rows
    with a positive channel 0 (what `write_agreeing_dflash` keys on) at unit RMS, and the last id's
    row (the DFlash mask token) zero, so the mask token is never predicted."""
    make_near_bigram(target_dir, 0)

    def fn(name, x):
        if name.endswith("layers.0.mlp.down_proj.weight"):
            return (x * mlp_scale).astype(x.dtype)
        if not name.endswith("embed_tokens.weight"):
            return x
        y = x.astype(np.float64)
        y[:, 0] = np.abs(y[:, 0]) + 0.5
        y /= np.sqrt(np.mean(y ** 2, axis=1, keepdims=True))
        y[-1] = 0.0
        return y.astype(x.dtype)

    _rewrite(target_dir, fn)


def write_agreeing_dflash(out_dir: str, target_dir: str, block_size: int = 4) -> dict:
    """A one-layer DFlash drafter for `make_block_bigram(target_dir)`: every mask position copies
    the block's first token b and applies the target's bigram to it, so every draft is the target's
    prediction after b (the first draft is mostly kept; later ones only where the bigram repeats).
    How: each head's query is a constant (q_proj's bias); keys are zero except b's (channel 0 of its
    embedding, positive, sets one key channel at the lowest RoPE frequency), so all attention goes
    to b; V and O are identities; the context adds nothing (hidden_norm 0); the MLP and its norm
    are the target's layer 0."""
    from safetensors.numpy import load_file

    tc = target_config(target_dir)
    e, vocab = tc["hidden_size"], tc["vocab_size"]
    heads = 4
    d = e // heads
    tgt = load_file(os.path.join(target_dir, "model.safetensors"))
    i = tgt["model.layers.0.mlp.gate_proj.weight"].shape[0]
    cfg = write_dflash(out_dir, target_dir, 0, target_layer_ids=[0], num_layers=1, block_size=block_size)
    cfg.update(num_attention_heads=heads, num_key_value_heads=heads, head_dim=d, attention_bias=True,
               rope_theta=1e9, intermediate_size=i)
    key = d // 2 - 1  # rotated at theta^-(d-2)/d: no rotation to speak of over these positions
    q_bias = np.zeros(e, np.float32)
    k_w = np.zeros((e, e), np.float32)
    for h in range(heads):
        q_bias[h * d + key] = 1.0
        k_w[h * d + key, 0] = 1.0
    p, zeros, eye = "layers.0", np.zeros(e, np.float32), np.eye(e, dtype=np.float32)
    tensors = {
        "fc.weight": _matrix(np.random.default_rng(0), e, e), "hidden_norm.weight": zeros,
        "norm.weight": np.ones(e, np.float32), f"{p}.input_layernorm.weight": np.ones(e, np.float32),
        f"{p}.post_attention_layernorm.weight": tgt["model.layers.0.post_attention_layernorm.weight"],
        f"{p}.self_attn.q_proj.weight": np.zeros((e, e), np.float32), f"{p}.self_attn.q_proj.bias": q_bias,
        f"{p}.self_attn.k_proj.weight": k_w, f"{p}.self_attn.k_proj.bias": zeros,
        f"{p}.self_attn.v_proj.weight": eye, f"{p}.self_attn.v_proj.bias": zeros,
        f"{p}.self_attn.o_proj.weight": eye, f"{p}.self_attn.o_proj.bias": zeros,
        f"{p}.self_attn.q_norm.weight": np.full(d, 10.0, np.float32),
        f"{p}.self_attn.k_norm.weight": np.full(d, 10.0, np.float32),
        **{f"{p}.mlp.{n}.weight": tgt[f"model.layers.0.mlp.{n}.weight"] for n in ("gate_proj", "up_proj", "down_proj")},
    }
    assert vocab - 1 == cfg["dflash_config"]["mask_token_id"]
    _save(out_dir, cfg, tensors)
    return cfg
