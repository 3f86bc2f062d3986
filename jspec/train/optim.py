"""AdamW with gradient clipping (optax) and a warmup + cosine learning-rate schedule.

The learning rate is an argument of the train step rather than part of the optimizer state: the
schedule then lives on the host, and a run with a time budget can fix its length after timing its
first steps without recompiling anything.
"""

from __future__ import annotations

import math

import jax
import optax


def fitted_steps(step: int, max_steps: int, *, per_step_s: float, left_s: float, margin: float) -> int:
    """Total steps of a schedule fixed under a time budget after `step` timed steps: as many as
    `left_s` (less a `margin` fraction for evaluations) holds at `per_step_s`, within [step, max_steps]."""
    return max(step, min(max_steps, step + int(left_s * (1 - margin) / per_step_s)))


def lr_at(step: int, *, peak: float, warmup: int, total: int, min_ratio: float = 0.1) -> float:
    """Linear warmup over `warmup` steps to `peak`, then cosine decay to `min_ratio * peak` at `total`."""
    if step < warmup:
        return peak * (step + 1) / warmup
    span = max(total - warmup, 1)
    progress = min(max(step - warmup, 0) / span, 1.0)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * progress)))


def decay_mask(params):
    """Weight decay on matrices (projections, embeddings, experts); none on norms, biases, GDN gates."""
    return jax.tree_util.tree_map(lambda p: p.ndim >= 2, params)


def adamw(*, b1: float = 0.9, b2: float = 0.95, eps: float = 1e-8, weight_decay: float = 0.1,
          grad_clip: float = 1.0) -> optax.GradientTransformation:
    """AdamW without its learning rate: updates come out scaled for lr = 1; the step multiplies by -lr.
    Decoupled decay as in optax.adamw (decay added to the Adam direction, then scaled by lr)."""
    parts = [optax.clip_by_global_norm(grad_clip)] if grad_clip > 0 else []
    parts += [optax.scale_by_adam(b1=b1, b2=b2, eps=eps),
              optax.add_decayed_weights(weight_decay, mask=decay_mask)]
    return optax.chain(*parts)


def apply_lr(params, updates, lr):
    return jax.tree_util.tree_map(lambda p, u: (p - lr * u).astype(p.dtype), params, updates)
