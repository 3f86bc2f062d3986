"""Tensor parallelism: how a target's parameters and pools split over the mesh axis `tp`.

Megatron-style splits, written as one `PartitionSpec` per parameter name (`param_spec`):
- attention by heads: the fused q/k/v projection column-parallel, o_proj row-parallel. With fewer
  KV heads G than `tp_size` each KV head is replicated tp/G times (`kv_heads`), so every device owns
  exactly one, as vLLM and SGLang do;
- SwiGLU (dense MLP, shared expert) column-parallel gate/up, row-parallel down;
- MoE by each expert's intermediate dimension: every device holds every expert, a 1/tp slice of
  each, so any expert count works and routing needs no all-to-all; or, with expert parallelism
  (`ep`, SGLang's ep_size = tp_size), by whole experts: each device holds X/tp experts and runs the
  routed pairs that fall on them (the others masked), and the partial outputs are summed;
- Gated DeltaNet by key/value heads: projections, conv channels, gates and the state pool split
  with them, out_proj row-parallel;
- vocabulary-parallel embedding and lm_head, the vocabulary padded to a multiple of tp
  (`padded_vocab`; the pad rows are zero and `CausalLM.compute_logits` drops their columns).

A fused projection concatenates several outputs ([q | k | v], [gate | up], conv [q | k | v]), so a
contiguous split of its rows would hand device 0 all of q and nothing of v. At tp > 1 those rows
are stored *shard-major* instead: [q_0 k_0 v_0 | q_1 k_1 v_1 | ...], device s's rows contiguous.
`to_tp_layout` permutes a checkpoint's (tp = 1) tensor into that order on the host, once, at load;
the model splits its outputs with `split_shard_major`. At tp = 1 both are the identity.

Only the target is split: drafters (one or two layers) are replicated on every device. The pools
split with the layers that write them (`jspec.cache.pool.pool_specs`).

`replicate_attention` keeps the token mixers (attention and Gated DeltaNet layers, their KV pages
and state pools) whole on every device, each computing them for every request, and splits the
feed-forward blocks and the vocabulary only. A split mixer ends in a row-parallel projection and so
in an all-reduce; a replicated one does not, which halves a decode step's all-reduces (one per layer
instead of two) and the pieces the host launches, for a larger read of mixer weights per device and
whole KV / state pools on each. Off by default: whether it pays depends on the model and the step
(bench/README.md, "Tensor parallelism").
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from jspec.config import ModelConfig
from jspec.errors import ConfigError

TP = "tp"  # the mesh axis name


def make_mesh(tp_size: int, devices=None) -> Mesh:
    """A one-axis mesh over the first tp_size local devices."""
    devices = list(jax.devices() if devices is None else devices)
    return Mesh(np.array(devices[:tp_size]), (TP,))


def replicated(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def kv_heads(num_kv_heads: int, tp_size: int) -> int:
    """KV heads the target's pools and projection hold: G, or tp when G < tp (each replicated)."""
    return num_kv_heads if num_kv_heads % tp_size == 0 else tp_size


def padded_vocab(vocab_size: int, tp_size: int) -> int:
    return -(-vocab_size // tp_size) * tp_size


def mixer_tp(tp_size: int, replicate_attention: bool) -> int:
    """The ways the token mixers (attention, Gated DeltaNet) are split: 1 when replicated."""
    return 1 if replicate_attention else tp_size


def check_tp(config: ModelConfig, tp_size, num_devices: int | None = None, *, ep: bool = False,
             replicate_attention: bool = False) -> int:
    """ConfigError for a split that cannot work, naming the field and the numbers; returns tp_size.
    ep: experts split whole (expert parallelism) rather than by their intermediate dimension;
    replicate_attention: the token mixers kept whole, so their head counts need not divide."""
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ConfigError(f"tp_size must be a positive int, got {tp_size!r}")
    num_devices = len(jax.devices()) if num_devices is None else num_devices
    if tp_size > num_devices:
        raise ConfigError(f"tp_size={tp_size} but only {num_devices} device(s) are visible "
                          f"({jax.default_backend()}); lower tp_size")
    if tp_size == 1:
        return 1

    def need(field: str, value: int) -> None:
        if value % tp_size:
            raise ConfigError(f"tp_size={tp_size} does not divide {field}={value}")

    if config.attention_layer_ids and not replicate_attention:
        need("num_attention_heads", config.num_attention_heads)
        g = config.num_key_value_heads
        if g % tp_size and tp_size % g:
            raise ConfigError(f"tp_size={tp_size} and num_key_value_heads={g}: one must divide the other "
                              "(KV heads split over devices, or each replicated on tp/G of them)")
    if not all(config.moe_layers):
        need("intermediate_size", config.intermediate_size)
    if any(config.moe_layers) and ep:
        need("num_experts", config.num_experts)
    elif any(config.moe_layers):
        need("moe_intermediate_size", config.moe_intermediate_size)
        if config.shared_expert_intermediate_size:
            need("shared_expert_intermediate_size", config.shared_expert_intermediate_size)
    if config.gdn_layer_ids and not replicate_attention:
        need("linear_num_key_heads", config.linear_num_key_heads)
        need("linear_num_value_heads", config.linear_num_value_heads)
    return tp_size


# ------------------------------------------------------------------------------- parameter specs

_COL, _ROW, _REP = P(TP, None), P(None, TP), P()
# (name pattern, spec): the first match wins. Column-parallel weights `[out, in]` split rows, their
# biases with them; row-parallel weights split columns and keep their bias whole (added once,
# after the reduction).
_RULES = (
    (r"embed_tokens\.weight$|lm_head\.weight$", _COL),
    (r"self_attn\.qkv_proj\.weight$", _COL),
    (r"self_attn\.qkv_proj\.bias$", P(TP)),
    (r"self_attn\.o_proj\.weight$", _ROW),
    (r"(mlp|shared_expert)\.gate_up_proj\.weight$", _COL),
    (r"(mlp|shared_expert)\.gate_up_proj\.bias$", P(TP)),
    (r"(mlp|shared_expert)\.down_proj\.weight$", _ROW),
    (r"mlp\.experts\.gate_up_proj$", P(None, None, TP)),  # [X, E, 2I]
    (r"mlp\.experts\.down_proj$", P(None, TP, None)),  # [X, I, E]
    (r"linear_attn\.in_proj_\w+\.weight$", _COL),
    (r"linear_attn\.conv1d\.weight$", P(TP, None, None)),  # [C, 1, K]
    (r"linear_attn\.(dt_bias|A_log)$", P(TP)),
    (r"linear_attn\.out_proj\.weight$", _ROW),
    # Replicated: norms, the router, the shared expert's gate, row-parallel biases.
    (r"norm\.weight$|mlp\.gate\.weight$|shared_expert_gate\.weight$|(o_proj|down_proj)\.bias$", _REP),
)
_COMPILED = tuple((re.compile(p), s) for p, s in _RULES)


_EXPERTS = re.compile(r"mlp\.experts\.(gate_up|down)_proj$")
_MIXERS = re.compile(r"\.(self_attn|linear_attn)\.")


def is_mixer(name: str) -> bool:
    """Whether a target parameter (jspec name) belongs to a token mixer (attention, Gated DeltaNet)."""
    return bool(_MIXERS.search(name))


def param_spec(name: str, *, ep: bool = False, replicate_attention: bool = False) -> P:
    """The PartitionSpec of a target parameter (jspec name, e.g. `model.layers.0.mlp.down_proj.weight`);
    ep: experts split whole (`[X, ...]` by X); replicate_attention: the token mixers' parameters whole."""
    if ep and _EXPERTS.search(name):
        return P(TP, None, None)
    if replicate_attention and is_mixer(name):
        return _REP
    for pattern, spec in _COMPILED:
        if pattern.search(name):
            return spec
    raise KeyError(f"no tensor-parallel rule for parameter {name!r}")


def path_name(path) -> str:
    return ".".join(str(getattr(k, "key", getattr(k, "idx", k))) for k in path)


# ------------------------------------------------------------------------------- layouts

def _shard_major(arr: np.ndarray, sizes: list[int], tp: int, axis: int) -> np.ndarray:
    """Parts of `sizes` along axis, each cut in tp chunks, regrouped device by device."""
    parts = np.split(arr, np.cumsum(sizes)[:-1], axis=axis)
    chunks = [np.split(p, tp, axis=axis) for p in parts]
    return np.concatenate([c[s] for s in range(tp) for c in chunks], axis=axis)


def _unshard_major(arr: np.ndarray, sizes: list[int], tp: int, axis: int) -> np.ndarray:
    """The inverse of `_shard_major` (sizes: the parts' whole sizes)."""
    per_device = np.split(arr, tp, axis=axis)
    local = [s // tp for s in sizes]
    chunks = [np.split(d, np.cumsum(local)[:-1], axis=axis) for d in per_device]
    return np.concatenate([np.concatenate([c[i] for c in chunks], axis=axis) for i in range(len(sizes))], axis=axis)


_VOCAB = re.compile(r"embed_tokens\.weight$|lm_head\.weight$")
_QKV = re.compile(r"self_attn\.qkv_proj\.(weight|bias)$")


def _fused_parts(name: str, shape, config: ModelConfig) -> tuple[int, list[int]] | None:
    """(axis, part sizes) of a fused tensor stored shard-major at tp > 1 (q/k/v excepted), or None."""
    if re.search(r"(mlp|shared_expert)\.gate_up_proj\.(weight|bias)$", name):
        return 0, [shape[0] // 2] * 2
    if re.search(r"mlp\.experts\.gate_up_proj$", name):
        return len(shape) - 1, [shape[-1] // 2] * 2
    if re.search(r"linear_attn\.(conv1d|in_proj_qkv)\.weight$", name):
        return 0, [config.gdn_key_dim, config.gdn_key_dim, config.gdn_value_dim]
    return None


def _kv_rows(arr: np.ndarray, heads: int, d: int) -> np.ndarray:
    return arr.reshape(heads, d, *arr.shape[1:])


def _kept_whole(name: str, ep: bool, replicate_attention: bool) -> bool:
    """A parameter a split target stores in its tp = 1 layout (whole experts, replicated mixers)."""
    return bool((ep and _EXPERTS.search(name)) or (replicate_attention and is_mixer(name)))


def to_tp_layout(name: str, arr: np.ndarray, config: ModelConfig, tp: int, *, ep: bool = False,
                 replicate_attention: bool = False) -> np.ndarray:
    """A checkpoint tensor (tp = 1 layout) in the layout of a tp-way target (see the module doc);
    ep / replicate_attention: experts / mixers kept whole, so their tensors keep the tp = 1 layout."""
    if tp == 1 or _kept_whole(name, ep, replicate_attention):
        return arr
    if _VOCAB.search(name):
        pad = padded_vocab(config.vocab_size, tp) - arr.shape[0]
        return np.pad(arr, [(0, pad)] + [(0, 0)] * (arr.ndim - 1)) if pad else arr
    if _QKV.search(name):
        g, d = config.num_key_value_heads, config.head_dim
        g_tp, q_out = kv_heads(g, tp), arr.shape[0] - 2 * g * d
        q, k, v = np.split(arr, [q_out, q_out + g * d], axis=0)
        # Each KV head replicated on the tp/G devices whose query heads read it.
        k, v = (np.repeat(_kv_rows(x, g, d), g_tp // g, axis=0).reshape(g_tp * d, *x.shape[1:]) for x in (k, v))
        return _shard_major(np.concatenate([q, k, v]), [q_out, g_tp * d, g_tp * d], tp, axis=0)
    fused = _fused_parts(name, arr.shape, config)
    return arr if fused is None else _shard_major(arr, fused[1], tp, axis=fused[0])


def from_tp_layout(name: str, arr: np.ndarray, config: ModelConfig, tp: int, *, ep: bool = False,
                   replicate_attention: bool = False) -> np.ndarray:
    """The inverse of `to_tp_layout`: a tensor stored in a tp-way layout back in the tp = 1 one
    (a checkpoint converted for one split, loaded at another)."""
    if tp == 1 or _kept_whole(name, ep, replicate_attention):
        return arr
    if _VOCAB.search(name):
        return arr[: config.vocab_size]
    if _QKV.search(name):
        g, d = config.num_key_value_heads, config.head_dim
        g_tp = kv_heads(g, tp)
        q_out = arr.shape[0] - 2 * g_tp * d
        q, k, v = np.split(_unshard_major(arr, [q_out, g_tp * d, g_tp * d], tp, axis=0), [q_out, q_out + g_tp * d])
        # The first copy of each replicated KV head.
        k, v = (_kv_rows(x, g_tp, d)[:: g_tp // g].reshape(g * d, *x.shape[1:]) for x in (k, v))
        return np.concatenate([q, k, v])
    fused = _fused_parts(name, arr.shape, config)
    return arr if fused is None else _unshard_major(arr, fused[1], tp, axis=fused[0])


def split_shard_major(y, sizes: list[int], tp: int) -> list:
    """Split the last axis of a fused projection's output `[..., sum(sizes)]` into its parts, each
    `[..., size]` in its own canonical order; at tp > 1 the axis is shard-major (module doc)."""
    if tp == 1:
        return jnp.split(y, np.cumsum(sizes)[:-1].tolist(), axis=-1)
    lead = y.shape[:-1]
    local = [s // tp for s in sizes]
    parts = jnp.split(y.reshape(*lead, tp, sum(local)), np.cumsum(local)[:-1].tolist(), axis=-1)
    return [p.reshape(*lead, s) for p, s in zip(parts, sizes)]


def concat_shard_major(parts: list, tp: int):
    """The inverse of `split_shard_major`: parts `[..., n_i]` -> `[..., sum n_i]`, shard-major."""
    if tp == 1:
        return jnp.concatenate(parts, axis=-1)
    lead = parts[0].shape[:-1]
    local = [p.reshape(*lead, tp, p.shape[-1] // tp) for p in parts]
    return jnp.concatenate(local, axis=-1).reshape(*lead, sum(p.shape[-1] for p in parts))
