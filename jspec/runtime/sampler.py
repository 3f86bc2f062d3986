"""Token sampling on the device: penalties, temperature, top-k / top-p / min-p, seeded draws.

Pure jnp with static shapes: it runs inside the jitted step and never waits for the host.
Semantics follow SGLang:

- Penalties (`apply_penalties`): the repetition penalty acts on every token seen in the prompt or
  the output (a positive logit is divided by it, a negative one multiplied); then the frequency
  penalty subtracts `f * count` and the presence penalty `p * [count > 0]`, output tokens only.
- Logit bias (`add_logit_bias`): each request's own {token: bias} is added after the penalties.
- Filters (`filtered_probs`) are judged jointly on one distribution, softmax(logits / T), and their
  kept sets intersected (SGLang's torch path and flashinfer's "joint" order): top-k keeps the k most
  probable tokens; top-p keeps a token when the mass of the tokens ranked before it is < top_p (so
  the kept prefix is the smallest one whose mass reaches top_p); min-p keeps p >= min_p * max p.
  The kept probabilities are renormalised. Rows with temperature 0 are greedy: a one-hot.
- Ties: equal probabilities rank the lower token id first, everywhere (top-k, top-p, greedy argmax,
  top logprobs), so a result never depends on how a sort or a reduction happens to order ties.
- Reported logprobs are log_softmax(penalised logits / T), before top-k / top-p / min-p, with T = 1
  for greedy rows: SGLang's default (it reports the processed distribution, not the raw one).
- Randomness: row r draws with key fold_in(fold_in(key(0), seed[r]), step[r]), so a seeded request
  gets the same tokens whatever else shares its batch and whatever the batch size.

Per-request token statistics live on the device per request slot, `output_counts [num_slots, V]`
int32 and `prompt_mask [num_slots, V]` bool; the engine gathers the batch's rows by slot before
`sample` and keeps them current with `update_counts`, `add_prompt_tokens` and `reset_slots`. So
does each slot's logit bias (`DeviceState.logit_bias_ids` / `logit_bias_values`, written by the
request's prompt steps), which the step puts into the `SamplingBatch`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jspec.models import ops
from jspec.runtime.sampling_params import GREEDY_TEMPERATURE


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SamplingBatch:
    """Per-row sampling parameters, all `[B]`. temperature 0 = greedy; top_k -1 or >= V = off."""

    temperature: jax.Array  # f32
    top_p: jax.Array  # f32
    top_k: jax.Array  # i32
    min_p: jax.Array  # f32
    repetition_penalty: jax.Array  # f32
    frequency_penalty: jax.Array  # f32
    presence_penalty: jax.Array  # f32
    seed: jax.Array  # u32 (or i32)
    step: jax.Array  # i32: index of the token being sampled in the request's output (0 = first)
    # i32: top logprobs the row's request returns; the top k is taken only for rows with some
    # (None: every row)
    top_logprobs_num: jax.Array | None = None
    # `[B, K]` i32 / f32: the row's biased tokens (-1: none) and their biases (None: no bias)
    logit_bias_ids: jax.Array | None = None
    logit_bias_values: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SampleOutput:
    """tokens, logprobs: [B]; top_ids, top_logprobs: [B, num_top_logprobs] (most probable first)."""

    tokens: jax.Array  # i32
    logprobs: jax.Array  # f32
    top_ids: jax.Array  # i32
    top_logprobs: jax.Array  # f32


def wants_top_logprobs(batch: SamplingBatch) -> jax.Array | None:
    """`[B]` bool: the rows whose top logprobs are returned (None: every row)."""
    return None if batch.top_logprobs_num is None else batch.top_logprobs_num > 0


def _greedy_rows(batch: SamplingBatch) -> jax.Array:
    # Same threshold as SamplingParams.is_greedy.
    return batch.temperature < GREEDY_TEMPERATURE


def apply_penalties(
    logits: jax.Array, batch: SamplingBatch, output_counts: jax.Array, prompt_mask: jax.Array
) -> jax.Array:
    """Repetition, frequency and presence penalties on `[B, V]` logits (see the module doc)."""
    in_output = output_counts > 0
    rep = batch.repetition_penalty[:, None]
    repeated = jnp.where(logits > 0, logits / rep, logits * rep)
    logits = jnp.where(prompt_mask | in_output, repeated, logits)
    logits = logits - batch.frequency_penalty[:, None] * output_counts.astype(logits.dtype)
    return logits - batch.presence_penalty[:, None] * in_output.astype(logits.dtype)


def add_logit_bias(logits: jax.Array, batch: SamplingBatch, *, tp: int = 1) -> jax.Array:
    """logits `[B, ..., V]` with each row's bias added at its tokens (every node of a row alike);
    tp: the vocabulary's split (`ops.vocab_add`)."""
    if batch.logit_bias_ids is None:
        return logits
    lead, k = logits.shape[:-1], batch.logit_bias_ids.shape[-1]
    grow = lambda a: jnp.broadcast_to(a.reshape(a.shape[:1] + (1,) * (len(lead) - 1) + (k,)), lead + (k,))  # noqa: E731
    return ops.vocab_add(logits, grow(batch.logit_bias_ids), grow(batch.logit_bias_values).astype(logits.dtype), tp=tp)


def processed_logprobs(logits: jax.Array, batch: SamplingBatch) -> jax.Array:
    """log_softmax(penalised logits / T): the distribution that is filtered and reported."""
    return logprobs_at_temperature(logits, batch.temperature)


def logprobs_at_temperature(logits: jax.Array, temperature: jax.Array) -> jax.Array:
    """log_softmax(logits `[R, V]` / T) with T `[R]`. Greedy rows take T = 1: their token is the
    argmax either way, and SGLang reports their logprobs unscaled."""
    t = jnp.where(temperature < GREEDY_TEMPERATURE, 1.0, temperature)
    return jax.nn.log_softmax(logits / t[:, None], axis=-1)


def _top_k_top_p_keep(probs: jax.Array, top_k: jax.Array, top_p: jax.Array) -> jax.Array:
    """Which tokens survive top-k and top-p: a prefix of the tokens ranked by (-p, id).

    One full sort along V (exact: no approximate top-k cap). Rather than scattering the sorted
    mask back, the prefix is described by its last element (cut_p, cut_id), and a token is kept
    when it ranks no lower: p > cut_p, or p == cut_p and id <= cut_id.
    """
    vocab = probs.shape[-1]
    ids = jax.lax.broadcasted_iota(jnp.int32, probs.shape, 1)
    # A stable sort keeps equal probabilities in id order: the lower id ranks first.
    neg_sorted_p, sorted_ids = jax.lax.sort((-probs, ids), dimension=1, is_stable=True, num_keys=1)
    sorted_p = -neg_sorted_p
    # Mass strictly before each rank (an exclusive prefix sum; cumsum - p would add rounding).
    mass_before = jnp.concatenate(
        [jnp.zeros_like(sorted_p[:, :1]), jnp.cumsum(sorted_p[:, :-1], axis=1)], axis=1
    )
    # top_p = 1 keeps everything explicitly: float rounding can push the mass before the last
    # tokens up to 1.0, which `< 1` would wrongly drop.
    n_top_p = jnp.where(top_p >= 1.0, vocab, jnp.sum(mass_before < top_p[:, None], axis=1))
    n_keep = jnp.maximum(jnp.minimum(top_k, n_top_p), 1)[:, None]
    cut_p = jnp.take_along_axis(sorted_p, n_keep - 1, axis=1)
    cut_id = jnp.take_along_axis(sorted_ids, n_keep - 1, axis=1)
    return (probs > cut_p) | ((probs == cut_p) & (ids <= cut_id))


def _filter(logprobs: jax.Array, logits: jax.Array, batch: SamplingBatch, sort: bool | None = None,
            tp: int = 1) -> jax.Array:
    """Filtered, renormalised probabilities from the processed logprobs; greedy rows one-hot.

    sort: None decides on the device (a lax.cond, whose predicate XLA on GPU copies to the host
    during the launch); True / False is the caller's static promise that some / no row needs top-k
    or top-p, so no conditional is compiled at all."""
    probs = jnp.exp(logprobs)
    vocab = probs.shape[-1]
    greedy = _greedy_rows(batch)
    top_k = jnp.where((batch.top_k <= 0) | (batch.top_k >= vocab), vocab, batch.top_k).astype(jnp.int32)
    # The sort is the expensive part; most batches (greedy, plain temperature) need none of it.
    # Both branches give the same mask for a row without top-k / top-p, so which branch runs never
    # changes a row's result.
    if sort is True:
        keep = _top_k_top_p_keep(probs, top_k, batch.top_p)
    elif sort is False:
        keep = jnp.ones(probs.shape, jnp.bool_)
    else:
        needs_sort = jnp.any(~greedy & ((top_k < vocab) | (batch.top_p < 1.0)))
        keep = jax.lax.cond(
            needs_sort,
            _top_k_top_p_keep,
            lambda p, k, tp: jnp.ones(p.shape, jnp.bool_),
            probs,
            top_k,
            batch.top_p,
        )
    keep &= probs >= batch.min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    kept = jnp.where(keep, probs, 0.0)
    kept = kept / jnp.sum(kept, axis=-1, keepdims=True)
    # argmax returns the first maximum: ties go to the lower id.
    one_hot = jax.nn.one_hot(ops.vocab_argmax(logits, tp=tp), vocab, dtype=kept.dtype)
    return jnp.where(greedy[:, None], one_hot, kept)


def filtered_probs(logits: jax.Array, batch: SamplingBatch, sort: bool | None = None, tp: int = 1) -> jax.Array:
    """`[B, V]` probabilities that `sample` draws from, given already penalised logits (`sort` as in
    `_filter`; tp: the vocabulary's split)."""
    logits = logits.astype(jnp.float32)
    return _filter(processed_logprobs(logits, batch), logits, batch, sort, tp)


def hold_stops(logits: jax.Array, index: jax.Array, min_new: jax.Array, stop_ids: jax.Array) -> jax.Array:
    """min_new_tokens (SGLang's): a row's stop tokens (EOS and its stop_token_ids) are impossible
    while its output is shorter than min_new. logits `[B, N, V]`, index `[B, N]` the output index of
    the token each node draws, min_new `[B]`, stop_ids `[B, K]` (-1: none)."""
    b, _, v = logits.shape
    stop = jnp.zeros((b, v), bool).at[jnp.arange(b)[:, None], jnp.where(stop_ids >= 0, stop_ids, v)].set(
        True, mode="drop")
    held = (index < min_new[:, None])[:, :, None] & stop[:, None, :]
    return jnp.where(held, -jnp.inf, logits)


def apply_bitmask(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """Structured output: logits `[..., V]` with the tokens a grammar forbids at -inf. mask
    `[..., W]` int32, bit v % 32 of word v // 32 set where token v is allowed (llguidance's layout)."""
    ids = jnp.arange(logits.shape[-1], dtype=jnp.int32)
    allowed = (jnp.right_shift(mask[..., ids // 32], ids % 32) & 1) > 0
    return jnp.where(allowed, logits, -jnp.inf)


def row_key(seed: jax.Array, step: jax.Array) -> jax.Array:
    return jax.random.fold_in(jax.random.fold_in(jax.random.key(0), seed), step)


def categorical(keys, logp, *, tp: int = 1):
    """`jax.random.categorical` per row (keys `[B]`, logp `[B, V]`), as the Gumbel-max it is: the
    same Gumbel noise, then the argmax over a vocabulary split tp ways (`ops.vocab_argmax`)."""
    if tp == 1:
        return jax.vmap(jax.random.categorical)(keys, logp)
    noise = jax.vmap(lambda k: jax.random.gumbel(k, logp.shape[-1:], logp.dtype))(keys)
    return ops.vocab_argmax(noise + logp, tp=tp)


def sample(
    logits: jax.Array,
    batch: SamplingBatch,
    output_counts: jax.Array,
    prompt_mask: jax.Array,
    *,
    num_top_logprobs: int,
    sort: bool | None = None,
    vocab_shards: int = 1,
) -> SampleOutput:
    """Penalise, bias, filter and draw one token per row. `num_top_logprobs`, `sort` (see
    `_filter`) and `vocab_shards` (the target's tensor-parallel split of the vocabulary) are static."""
    logits = apply_penalties(logits.astype(jnp.float32), batch, output_counts, prompt_mask)
    logits = add_logit_bias(logits, batch, tp=vocab_shards)
    logprobs = processed_logprobs(logits, batch)
    probs = _filter(logprobs, logits, batch, sort, vocab_shards)
    keys = jax.vmap(row_key)(batch.seed, batch.step)
    # log(0) = -inf: filtered-out tokens can never win the Gumbel-max inside categorical.
    drawn = categorical(keys, jnp.log(probs), tp=vocab_shards)
    greedy_tokens = ops.vocab_argmax(logits, tp=vocab_shards)
    tokens = jnp.where(_greedy_rows(batch), greedy_tokens, drawn).astype(jnp.int32)
    chosen = ops.vocab_take(logprobs, tokens[:, None], tp=vocab_shards)[:, 0]
    if num_top_logprobs > 0:
        # lax.top_k lists equal values lower index first, like every other tie here.
        top_logprobs, top_ids = ops.vocab_top_k(logprobs, num_top_logprobs, tp=vocab_shards,
                                                rows=wants_top_logprobs(batch))
    else:
        top_logprobs = jnp.zeros((logits.shape[0], 0), jnp.float32)
        top_ids = jnp.zeros((logits.shape[0], 0), jnp.int32)
    return SampleOutput(tokens=tokens, logprobs=chosen, top_ids=top_ids.astype(jnp.int32), top_logprobs=top_logprobs)


def update_counts(output_counts: jax.Array, rows_slots: jax.Array, tokens: jax.Array, mask: jax.Array) -> jax.Array:
    """output_counts[slot, token] += 1 where mask.

    rows_slots: [B]; tokens, mask: [B] (one token per row) or [B, N] (the tokens a speculative step
    accepted per row). Repeated (slot, token) pairs all count: a scatter-add sums duplicates.
    Masked-out entries add 0, so their slot and token may be padding.
    """
    trailing = (1,) * (tokens.ndim - rows_slots.ndim)
    slots = jnp.broadcast_to(rows_slots.reshape(rows_slots.shape + trailing), tokens.shape)
    return output_counts.at[slots, tokens].add(mask.astype(output_counts.dtype), mode="drop")


def add_prompt_tokens(
    prompt_mask: jax.Array, slots_per_token: jax.Array, token_ids: jax.Array, valid: jax.Array
) -> jax.Array:
    """prompt_mask[slot, token] = True for each valid prompt token (all `[T]`, e.g. a prefill chunk)."""
    # Invalid (padding) tokens are sent out of bounds and dropped, rather than written as False:
    # a scatter that sets one index to both True and False has no defined winner.
    slots = jnp.where(valid, slots_per_token, prompt_mask.shape[0])
    return prompt_mask.at[slots, token_ids].set(True, mode="drop")


def seed_slot(output_counts: jax.Array, prompt_mask: jax.Array, slot: jax.Array, words: jax.Array):
    """A slot handed to a request whose prompt starts in the prefix cache, with a repetition
    penalty: counts cleared, prompt_mask set to the tokens of the cached part (which no step feeds;
    words `[W]` int32, bit t % 32 of word t // 32 for token t). The first chunk adds the rest."""
    bits = (words[:, None] >> jnp.arange(32, dtype=jnp.int32)) & 1
    row = bits.reshape(-1)[:prompt_mask.shape[1]] > 0
    return output_counts.at[slot].set(0), prompt_mask.at[slot].set(row)


def reset_slots(output_counts: jax.Array, prompt_mask: jax.Array, slots: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Clear the statistics of slots handed to new requests; pad `slots` with num_slots (dropped)."""
    return (
        output_counts.at[slots].set(0, mode="drop"),
        prompt_mask.at[slots].set(False, mode="drop"),
    )
