"""The frozen target inside a drafter's loss.

A drafter learns the target's own next-token distribution and reads the target's hidden states,
so the target runs inside the jitted train step (online training, in SpecForge's terms) rather
than from features stored beforehand: no disk traffic, and every window is fresh. Its parameters
travel in the step's `frozen` argument, outside the optimizer, and its outputs are cut off from
the gradient.

`frozen`: {"target": the target's parameters, "rest": the drafter's non-trained state (EAGLE3's
d2t; empty for MTP), ...} plus whatever else a trainer's loss reads (EAGLE3's "hot_ids").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jspec.train.dense import dense_forward
from jspec.train.loop import TrainConfig


def cast_floating(tree, dtype):
    """Every floating leaf of a pytree in `dtype` (integer tables such as d2t stay)."""
    dtype = jnp.dtype(dtype)

    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) and x.dtype != dtype else x

    return jax.tree_util.tree_map(cast, tree)


def target_fn_for(cfg: TrainConfig):
    """The frozen target's forward for training: `target_fn(target, ids, capture_layers)`, ids
    `[B, T]` -> (logits `[B, T, V]`, final normed hidden `[B, T, E]`, captured streams
    `[B, T, n, E]` or None), dense, with the run's attention implementation."""
    def target_fn(target, ids, capture_layers):
        return dense_forward(target, ids, capture_layers=tuple(capture_layers), attention_impl=cfg.attention_impl)

    return target_fn


def merged(target_graphdef, drafter_graphdef, params, frozen, compute_dtype):
    """(target, drafter) modules inside a loss: the frozen target, and the drafter from its trained
    parameters cast to the compute dtype (the float32 masters stay with the optimizer) plus its
    non-trained state (`frozen["rest"]`)."""
    return (nnx.merge(target_graphdef, frozen["target"]),
            nnx.merge(drafter_graphdef, cast_floating(params, compute_dtype), frozen["rest"]))


def captured_features(target_fn, target, window, capture_layers):
    """The frozen target over the window's first T tokens: (logits `[B, T, V]`, captured streams
    folded to `[B, T, n*E]`), both outside the gradient."""
    logits, _, aux = target_fn(target, window[:, :-1], tuple(capture_layers))
    b, t, n, e = aux.shape
    return jax.lax.stop_gradient(logits), jax.lax.stop_gradient(aux.reshape(b, t, n * e))
