"""Training-time test (TTT): a hidden-state drafter unrolled over its draft steps in one dense
forward, and the loss of every unrolled step against the frozen target.

At inference a hidden-state drafter (EAGLE3, MTP) first catches up over the verified tokens (one
causal extend: at KV index p it reads the token at p + 1 and the target's hidden at p), then
drafts: draft step i >= 1 is a decode at KV index o + i that reads the token at o + i + 1 and its
own previous output, where o is the last caught-up index (`jspec.speculative.eagle_step`). It sees
the catch-up entries 0 .. o and the entries of draft steps 1 .. i at o + 1 .. o + i, nothing else.

Training runs every origin o of a window at once: unroll step 0 is the catch-up over the whole
window, step i >= 1 holds at row o what draft step i computes for a chain started at o. Indexed by
origin, the feedback is row to row (step i reads step i - 1's output at the same row), the input
tokens move left by i, the RoPE positions right by i, and the attention of step i at row o is
step 0's keys at rows <= o (causal) plus steps 1 .. i's keys at row o only (a diagonal each).
One forward over T rows thus trains T chains, each seeing exactly what the engine shows it.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jspec.models.attention import Attention
from jspec.models.rope import rope_cos_sin


# ----------------------------------------------------------------------------- unrolled inputs
def shifted(x, i: int, fill=0):
    """x `[B, T, ...]` moved left by i rows along axis 1, the last i rows filled (rows o + i -> o)."""
    if i == 0:
        return x
    pad = jnp.full((x.shape[0], i) + x.shape[2:], fill, x.dtype)
    return jnp.concatenate([x[:, i:], pad], axis=1)


def step_tokens(window, i: int):
    """Input tokens of unroll step i `[B, T]` from a window `[B, T+1]`: row o reads the token at
    o + i + 1 (0 past the window; such rows are never scored)."""
    return shifted(window[:, 1:], i)


def step_positions(seq_len: int, i: int):
    """RoPE positions of unroll step i `[T]`: row o sits at KV index o + i."""
    return jnp.arange(seq_len, dtype=jnp.int32) + i


def valid_rows(seq_len: int, i: int):
    """`[T]` rows of unroll step i whose prediction (the token at o + i + 2) the window holds, with
    the target's distribution for it (the target runs over the first T tokens)."""
    return jnp.arange(seq_len) <= seq_len - 2 - i


# ----------------------------------------------------------------------------- attention
def ttt_attention(q, ks, vs, *, scale: float):
    """Attention of unroll step i = len(ks) - 1 (see the module docstring), in float32 as the
    engine's kernels compute it. q `[B, T, H, D]`; ks, vs: steps 0 .. i, each `[B, T, G, D]`.

    Step 0's keys form a causal `[T, T]` block; each later step adds one score per row (its own
    key at the same row), so the scores are `[B, G, H/G, T, T + i]` rather than a mask over
    `(i + 1) T` keys."""
    b, t, h, d = q.shape
    g = ks[0].shape[2]
    qf = q.astype(jnp.float32).reshape(b, t, g, h // g, d)
    causal = jnp.tril(jnp.ones((t, t), bool))
    s0 = jnp.einsum("btgqd,bsgd->bgqts", qf, ks[0].astype(jnp.float32)) * scale
    s0 = jnp.where(causal, s0, -jnp.inf)
    diag = [jnp.einsum("btgqd,btgd->bgqt", qf, k.astype(jnp.float32))[..., None] * scale for k in ks[1:]]
    p = jax.nn.softmax(jnp.concatenate([s0, *diag], axis=-1), axis=-1)  # [B, G, q, T, T + i]
    out = jnp.einsum("bgqts,bsgd->btgqd", p[..., :t], vs[0].astype(jnp.float32))
    for j, v in enumerate(vs[1:]):
        out = out + jnp.einsum("bgqt,btgd->btgqd", p[..., t + j], v.astype(jnp.float32))
    return out.reshape(b, t, h, d).astype(q.dtype)


def ttt_self_attention(attn: Attention, x, positions, rope, kv: list):
    """One unroll step of a drafter's attention over x `[B, T, Ein]` at RoPE positions `[T]`:
    appends this step's (k, v) to `kv` (the steps so far) and returns the output `[B, T, E]`.
    Projections and output are the module's own (`Attention.project` / `output`), so the trained
    parameters are the ones the engine's paged path reads."""
    q, k, v, gate = attn.project(x, rope_cos_sin(rope, positions))
    kv.append((k, v))
    o = ttt_attention(q, [a for a, _ in kv], [c for _, c in kv], scale=attn.head_dim ** -0.5)
    return attn.output(o, gate)


# ----------------------------------------------------------------------------- objective
def ttt_objective(draft_logits: list, target_logits, *, hot_ids=None, step_weight: float = 0.8):
    """Loss and metrics of the unrolled drafter against the frozen target.

    draft_logits[i] `[B, T, Vd]` float32: unroll step i. target_logits `[B, T, V]`: the target
    over the window's first T tokens (row p predicts the token at p + 1), so step i at row o is
    scored against target row o + i + 1. hot_ids `[Vd]`: the target ids of the draft vocabulary
    (None: Vd == V, the identity).

    Per step: forward KL from the target's distribution, renormalised over the draft vocabulary,
    to the drafter's (the cross-entropy less the target's entropy: the same gradient, and 0 at a
    perfect match), on the rows whose target argmax the draft vocabulary holds (others can never be
    accepted), weighted step_weight ** i. Accuracy: the drafter's top-1 (as a target id) equals
    the target's argmax, over every scored row: the rate at which a greedy draft is accepted.
    Metrics: `loss_i`, `acc_i` per step."""
    t = target_logits.shape[1]
    loss = jnp.zeros((), jnp.float32)
    metrics = {}
    for i, dl in enumerate(draft_logits):
        tl = shifted(target_logits, i + 1).astype(jnp.float32)
        valid = jnp.broadcast_to(valid_rows(t, i), tl.shape[:2])
        top = jnp.argmax(tl, axis=-1)
        if hot_ids is None:
            sub, coverable = tl, valid
            guess = jnp.argmax(dl, axis=-1)
        else:
            in_vocab = jnp.zeros((tl.shape[-1],), bool).at[hot_ids].set(True)
            sub = jnp.take(tl, hot_ids, axis=-1)
            coverable = valid & in_vocab[top]
            guess = hot_ids[jnp.argmax(dl, axis=-1)]
        logp = jax.nn.log_softmax(sub, axis=-1)
        kl = jnp.sum(jnp.exp(logp) * (logp - jax.nn.log_softmax(dl.astype(jnp.float32), axis=-1)), axis=-1)
        step_loss = jnp.sum(jnp.where(coverable, kl, 0.0)) / jnp.maximum(jnp.sum(coverable), 1)  # [B, T] -> ()
        acc = jnp.sum(valid & (guess == top)) / jnp.maximum(jnp.sum(valid), 1)
        loss = loss + step_weight ** i * step_loss
        metrics[f"loss_{i}"] = step_loss
        metrics[f"acc_{i}"] = acc
    return loss, metrics
