"""Numpy references written from raw checkpoint tensors (float64): RMS norm, rotate-half RoPE,
dense causal attention, SwiGLU, and the tensors of a checkpoint directory. The drafter tests
(EAGLE / EAGLE3 heads, the DFlash block) spell their forwards out with these."""

from __future__ import annotations

import numpy as np


def rms(x, w, eps, zero_centred=False):
    y = x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + eps)
    return y * ((1.0 + w) if zero_centred else w)


def rope(x, theta, positions=None):
    """x [T, heads, D] at positions (default 0..T-1), full rotate-half RoPE."""
    t, _, d = x.shape
    pos = np.arange(t) if positions is None else np.asarray(positions)
    inv = 1.0 / theta ** (np.arange(0, d, 2) / d)
    ang = pos[:, None] * inv[None, :]
    cos, sin = np.cos(np.concatenate([ang, ang], -1))[:, None], np.sin(np.concatenate([ang, ang], -1))[:, None]
    rot = np.concatenate([-x[..., d // 2:], x[..., : d // 2]], axis=-1)
    return x * cos + rot * sin


def causal_attention(x, t, pre, cfg):
    h, g, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    n = x.shape[0]
    q = rope((x @ t[f"{pre}.q_proj.weight"].T).reshape(n, h, d), cfg["rope_theta"])
    k = rope((x @ t[f"{pre}.k_proj.weight"].T).reshape(n, g, d), cfg["rope_theta"])
    v = (x @ t[f"{pre}.v_proj.weight"].T).reshape(n, g, d)
    k, v = np.repeat(k, h // g, axis=1), np.repeat(v, h // g, axis=1)
    s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)
    s = np.where(np.tril(np.ones((n, n), bool))[None], s, -np.inf)
    p = np.exp(s - s.max(-1, keepdims=True))
    o = np.einsum("hqk,khd->qhd", p / p.sum(-1, keepdims=True), v).reshape(n, h * d)
    return o @ t[f"{pre}.o_proj.weight"].T


def swiglu(x, t, pre):
    gate, up = x @ t[f"{pre}.gate_proj.weight"].T, x @ t[f"{pre}.up_proj.weight"].T
    return (gate / (1 + np.exp(-gate)) * up) @ t[f"{pre}.down_proj.weight"].T


def read_tensors(d, strip=""):
    """Every tensor of the checkpoint directory d as float64, names without the prefix strip."""
    from checkpoints.safetensors_reader import SafetensorsCheckpoint

    ckpt = SafetensorsCheckpoint(d)
    return {n[len(strip):] if n.startswith(strip) else n: np.asarray(ckpt.get(n), np.float64)
            for n in ckpt.names()}


def target_embed_head(target_dir):
    """(embedding, lm_head) of a target directory; a tied head is the embedding."""
    t = read_tensors(target_dir)
    embed = t["model.embed_tokens.weight"]
    return embed, t.get("lm_head.weight", embed)
