"""EAGLE and EAGLE3 heads in their published format, or with random weights.

Format: an HF directory whose config.json describes a one-layer Llama and names the head in
`architectures`; tensors without the `model.` prefix (some writers add it; both are read).
- EAGLE: `fc` over [embedding | hidden] (with a bias in v1), `layers.0.*` without an input norm,
  optionally its own `embed_tokens`; a shipped `lm_head` is ignored, since SGLang drafts EAGLE
  with the target's.
- EAGLE3: `fc` over the captured target streams, `midlayer.*`, `norm`, `lm_head` over the
  `draft_vocab_size` ids, `d2t` (target id = draft id + d2t[draft id]) and `t2d` (its inverse, a
  mask over the target vocabulary, not needed to draft); config.json names the captured layers
  (`eagle3_capture_layers`).
"""

from __future__ import annotations

import numpy as np

from jspec.config import FULL_ATTENTION, ModelConfig, RopeConfig, parse_hf_config
from jspec.errors import CheckpointError, ConfigError, UnsupportedModelError
from jspec.models.drafters.eagle import EagleDrafter
from jspec.models.drafters.eagle3 import Eagle3Drafter
from jspec.models.drafters.reader import (DraftModel, TensorView, build_draft_model, checkpoint_storage,
                                          head_tensors, random_params, read_config_json, read_params)
from jspec.models.loader import Model

EAGLE_ARCHITECTURES = ("LlamaForCausalLMEagle", "LlamaForCausalLM", "EagleLlamaForCausalLM")
EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM")
D2T = "d2t"


# ----------------------------------------------------------------------------- config.json


def head_config(raw: dict, kind: str, target: ModelConfig) -> ModelConfig:
    """The head's layer config from its config.json `raw`, checked against the target.

    kind: "eagle" | "eagle3". The layer is Llama's, so the Llama parser reads it; the head's own
    architecture name is restored afterwards so the config says what was loaded.
    """
    arch = (raw.get("architectures") or [None])[0]
    allowed = EAGLE3_ARCHITECTURES if kind == "eagle3" else EAGLE_ARCHITECTURES
    if arch not in allowed:
        raise UnsupportedModelError(f"draft config.json: architectures={arch!r} is not an {kind.upper()} head "
                                    f"(expected one of {', '.join(allowed)})")
    if raw.get("num_hidden_layers", 1) != 1:
        raise UnsupportedModelError(f"draft config.json: num_hidden_layers={raw['num_hidden_layers']}: only "
                                    "one-layer heads are supported")
    patched = {k: v for k, v in raw.items() if k != "layer_types"}
    cfg = parse_hf_config({**patched, "architectures": ["LlamaForCausalLM"], "num_hidden_layers": 1})
    cfg = cfg.replace(architecture=arch, weight_prefix="")
    for field, value in (("hidden_size", cfg.hidden_size), ("target_hidden_size", raw.get("target_hidden_size"))):
        if value is not None and value != target.hidden_size:
            raise ConfigError(f"draft config.json: {field}={value} must equal the target's hidden_size="
                              f"{target.hidden_size} (the head reads and feeds back the target's hidden states)")
    if cfg.vocab_size != target.vocab_size:
        raise ConfigError(f"draft vocab_size={cfg.vocab_size} must equal the target's vocab_size={target.vocab_size}")
    return cfg


def eagle3_capture_layers(raw: dict, num_target_layers: int) -> tuple[int, ...]:
    """Target layers whose entering stream EAGLE3 reads, ascending (the order fc was trained on).

    config.json's `eagle_aux_hidden_state_layer_ids` name layers whose *output* is read, i.e.
    the stream entering layer id + 1. Without them, SGLang's default (2, L // 2, L - 3), which are
    entering indices already; for targets too shallow for those (tiny test models) they are
    clipped to [0, L] and, where that merges two, completed with the smallest unused indices, so
    there are always three distinct ones.
    """
    n_layers = num_target_layers
    eagle_cfg = raw.get("eagle_config") or {}
    ids = eagle_cfg.get("eagle_aux_hidden_state_layer_ids", raw.get("eagle_aux_hidden_state_layer_ids"))
    if ids is not None:
        layers = [int(i) + 1 for i in ids]
        # At least two: the head tells the target's streams [T, n*E] from its own fed-back hidden
        # [T, E] by width alone.
        if len(layers) < 2 or any(not 0 <= i <= n_layers for i in layers) or len(set(layers)) != len(layers):
            raise ConfigError(f"draft config.json: eagle_aux_hidden_state_layer_ids={list(ids)} must be at least "
                              f"two distinct layer ids in [-1, {n_layers - 1}] of the {n_layers}-layer target")
        return tuple(sorted(layers))
    if n_layers < 2:
        raise ConfigError(f"EAGLE3 needs a target with at least 2 layers, got {n_layers}")
    chosen = sorted({min(max(i, 0), n_layers) for i in (2, n_layers // 2, n_layers - 3)})
    spare = (i for i in range(n_layers + 1) if i not in chosen)
    while len(chosen) < 3:
        chosen.append(next(spare))
    return tuple(sorted(chosen))


def eagle3_draft_vocab(raw: dict, vocab: int) -> int:
    """Vd, the ids the head drafts over: config.json's `draft_vocab_size`, default the target's."""
    draft_vocab = int(raw.get("draft_vocab_size") or vocab)
    if not 0 < draft_vocab <= vocab:
        raise ConfigError(f"draft config.json: draft_vocab_size={draft_vocab} must be in [1, vocab_size={vocab}]")
    return draft_vocab


def head_drafter_config(kind: str, path: str, target: ModelConfig) -> ModelConfig:
    """The head's layer config from `path`'s config.json, with every check `load_head` makes
    before it reads tensors (kind: "eagle" | "eagle3"), in the same order, so the same error."""
    raw = read_config_json(path)
    cfg = head_config(raw, kind, target)
    checkpoint_storage(path)
    if kind == "eagle3":
        eagle3_draft_vocab(raw, target.vocab_size)
        eagle3_capture_layers(raw, target.num_hidden_layers)
    return cfg


# ----------------------------------------------------------------------------- loading


def read_d2t(view: TensorView, draft_vocab: int, vocab: int, required: bool) -> np.ndarray | None:
    """EAGLE3's d2t `[Vd]` int32, taken out of `view` (and t2d dropped), checked to map every
    draft id into [0, vocab); None when absent and not required (Vd == V needs no map)."""
    d2t = view.take(D2T)
    view.take("t2d")
    if d2t is None:
        if required:
            raise CheckpointError(f"missing tensor: draft_vocab_size={draft_vocab} < vocab_size={vocab} needs the "
                                  "draft -> target id map", tensor=view.stored(D2T))
        return None
    if d2t.shape != (draft_vocab,):
        raise CheckpointError(f"shape {tuple(d2t.shape)} does not match (draft_vocab_size,) = ({draft_vocab},)",
                              tensor=view.stored(D2T))
    targets = np.arange(draft_vocab) + d2t.astype(np.int64)
    if targets.min(initial=0) < 0 or targets.max(initial=0) >= vocab:
        raise CheckpointError(f"maps draft ids outside the target vocabulary [0, {vocab})", tensor=view.stored(D2T))
    return d2t.astype(np.int32)


def load_head(kind: str, path: str, target: Model, dt) -> DraftModel:
    """An EAGLE ("eagle") or EAGLE3 ("eagle3") head from its directory, in dtype `dt`.

    Which optional parts the module has (own embedding, own lm_head, fc bias, d2t) is read off
    the tensors present, so one module class serves every published variant.
    """
    tcfg = target.config
    raw = read_config_json(path)
    cfg = head_config(raw, kind, tcfg)
    drop = ("lm_head.weight",) if kind == "eagle" else ()
    view = head_tensors(path, drop=drop)
    fc_bias = "fc.bias" in view or bool(raw.get("bias", False))
    own_embed = "embed_tokens.weight" in view
    if kind == "eagle":
        return build_draft_model(kind, lambda: EagleDrafter(cfg, own_embed=own_embed, fc_bias=fc_bias, dtype=dt),
                                 lambda exp: read_params(view, exp, dt), dt, path)

    vocab = tcfg.vocab_size
    draft_vocab = eagle3_draft_vocab(raw, vocab)
    capture = eagle3_capture_layers(raw, tcfg.num_hidden_layers)
    e = cfg.hidden_size
    if "fc.weight" in view and view.shape("fc.weight") != (e, len(capture) * e):
        raise CheckpointError(f"shape {view.shape('fc.weight')}: fc reads the {len(capture)} captured target layers "
                              f"{capture} x hidden_size {e}, so its input width must be {len(capture) * e}",
                              tensor=view.stored("fc.weight"))
    d2t = read_d2t(view, draft_vocab, vocab, required=draft_vocab != vocab)
    # Without its own lm_head the head uses the target's (SGLang's load_lm_head_from_target).
    own_head = "lm_head.weight" in view or draft_vocab != vocab

    def make():
        return Eagle3Drafter(cfg, capture_layers=capture, draft_vocab_size=draft_vocab, own_embed=own_embed,
                             own_head=own_head, has_d2t=d2t is not None, fc_bias=fc_bias, dtype=dt)

    def flat(expected):
        expected = {k: v for k, v in expected.items() if k != D2T}
        params = read_params(view, expected, dt)
        return params if d2t is None else {**params, D2T: d2t}

    return build_draft_model(kind, make, flat, dt, path)


# ----------------------------------------------------------------------------- random weights


def _llama_head_config(target: ModelConfig, arch: str, *, intermediate_size=None, num_attention_heads=None,
                      num_key_value_heads=None, head_dim=None) -> ModelConfig:
    """A one-layer Llama head config shaped after the target, each shape overridable."""
    heads = num_attention_heads or target.num_attention_heads
    head_dim = head_dim or target.head_dim
    inter = intermediate_size or target.intermediate_size
    if inter <= 0:
        raise ConfigError("random drafter: the target has no dense intermediate_size; pass intermediate_size=")
    rope = target.rope
    if rope.rotary_dim != head_dim:  # heads are trained with full rotary
        rope = RopeConfig(theta=rope.theta, rotary_dim=head_dim)
    return ModelConfig(
        architecture=arch, family="llama", weight_prefix="", vocab_size=target.vocab_size,
        hidden_size=target.hidden_size, num_hidden_layers=1, num_attention_heads=heads,
        num_key_value_heads=num_key_value_heads or target.num_key_value_heads, head_dim=head_dim,
        intermediate_size=inter, rms_norm_eps=target.rms_norm_eps,
        max_position_embeddings=target.max_position_embeddings, tie_word_embeddings=False, attention_bias=False,
        mlp_bias=False, rope=rope, zero_centred_norm=False, qk_norm=False, attn_output_gate=False,
        layer_types=(FULL_ATTENTION,), moe_layers=(False,), torch_dtype=target.torch_dtype,
    )


def random_head(kind: str, target_model: Model, dt, rng: np.random.Generator, scale: float, **shape) -> DraftModel:
    """An EAGLE / EAGLE3 head with random weights, with the module a published head of the
    commonest variant loads into: the target's embedding, no fc bias, EAGLE3 with its own lm_head.

    shape: intermediate_size, num_attention_heads, num_key_value_heads, head_dim (default: the
    target's); EAGLE3 also draft_vocab_size (default the target's vocabulary, else a random
    sorted subset of it, mapped through d2t) and aux_layer_ids (config.json's convention).
    """
    tcfg = target_model.config
    draft_vocab = int(shape.pop("draft_vocab_size", tcfg.vocab_size)) if kind == "eagle3" else tcfg.vocab_size
    aux = shape.pop("aux_layer_ids", None) if kind == "eagle3" else None
    try:
        arch = "LlamaForCausalLMEagle3" if kind == "eagle3" else "LlamaForCausalLMEagle"
        cfg = _llama_head_config(tcfg, arch, **shape)
    except TypeError as e:
        raise ConfigError(f"random_drafter: {e}") from None
    d2t = None
    if kind == "eagle":
        def make():
            return EagleDrafter(cfg, own_embed=False, fc_bias=False, dtype=dt)
    else:
        if not 0 < draft_vocab <= tcfg.vocab_size:
            raise ConfigError(f"draft_vocab_size={draft_vocab} must be in [1, vocab_size={tcfg.vocab_size}]")
        raw = {} if aux is None else {"eagle_aux_hidden_state_layer_ids": list(aux)}
        capture = eagle3_capture_layers(raw, tcfg.num_hidden_layers)
        if draft_vocab != tcfg.vocab_size:
            hot = np.sort(rng.choice(tcfg.vocab_size, size=draft_vocab, replace=False))
            d2t = (hot - np.arange(draft_vocab)).astype(np.int32)

        def make():
            return Eagle3Drafter(cfg, capture_layers=capture, draft_vocab_size=draft_vocab, own_embed=False,
                                 own_head=True, has_d2t=d2t is not None, fc_bias=False, dtype=dt)

    fixed = {} if d2t is None else {D2T: d2t}
    return build_draft_model(kind, make, lambda exp: random_params(exp, rng, scale, zero_centred_norm=False,
                                                                   fixed=fixed), dt, "<random>")
