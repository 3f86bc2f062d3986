"""Jitted model forward and the research API's `score`: next-token logits for one sequence.

`score` runs the same paged path as the engine (KV written to pages, GDN state in a pool slot), so
it checks the serving numerics, not a separate dense implementation.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jspec.errors import InvalidRequestError
from jspec.cache.pool import Caches, allocate_caches, pool_shardings
from jspec.models import dispatch
from jspec.models.batch import ForwardBatch, ForwardMode

SCORE_PAGE_SIZE = 16


def _forward(graphdef, params, caches, batch, logits_indices, capture_layers):
    module = nnx.merge(graphdef, params)
    return module(batch, caches, logits_indices=logits_indices, capture_layers=capture_layers)


@functools.lru_cache(maxsize=None)
def jitted_forward(graphdef):
    """One jitted forward per graph definition: (params, caches, batch, logits_indices) -> (out, caches).

    Caches are donated, so the pools are updated in place on the device.
    """
    return jax.jit(
        functools.partial(_forward, graphdef),
        static_argnames=("capture_layers",),
        donate_argnums=(1,),
    )


def forward(model, caches: Caches, batch: ForwardBatch, logits_indices=None, capture_layers=()):
    with dispatch.tensor_parallel(model.mesh):  # a split model's kernels map over its mesh when traced
        return jitted_forward(model.graphdef)(model.params, caches, batch, logits_indices, tuple(capture_layers))


def _bucket(n: int, minimum: int = 16) -> int:
    return max(minimum, 1 << (max(n, 1) - 1).bit_length())


def single_sequence_batch(token_ids, *, page_size: int, padded_len: int) -> ForwardBatch:
    """A one-request extend batch over pages 0.. in order, state slot 0, fresh state."""
    n = len(token_ids)
    ids = np.zeros(padded_len, np.int32)
    ids[:n] = token_ids
    pages_per_seq = -(-padded_len // page_size)
    t = np.arange(padded_len, dtype=np.int32)
    slot_mapping = np.where(t < n, t, -1).astype(np.int32)  # pages in order: slot == position
    return ForwardBatch(
        input_ids=jnp.asarray(ids),
        positions=jnp.asarray(np.minimum(t, max(n - 1, 0)).astype(np.int32)),
        seq_lens=jnp.asarray([n], jnp.int32),
        cu_q_lens=jnp.asarray([0, n], jnp.int32),
        page_table=jnp.arange(pages_per_seq, dtype=jnp.int32)[None, :],
        slot_mapping=jnp.asarray(slot_mapping),
        state_slots=jnp.zeros((1,), jnp.int32),
        has_initial_state=jnp.zeros((1,), bool),
        mode=ForwardMode.EXTEND,
    )


def score_sequence(model, token_ids) -> np.ndarray:
    ids = np.asarray(token_ids, dtype=np.int64).reshape(-1)
    cfg = model.config
    if ids.size == 0:
        raise InvalidRequestError("token_ids: empty sequence")
    bad = ids[(ids < 0) | (ids >= cfg.vocab_size)]
    if bad.size:
        raise InvalidRequestError(f"token_ids: id {int(bad[0])} outside the vocabulary [0, {cfg.vocab_size})")
    padded = _bucket(ids.size)
    batch = single_sequence_batch(ids, page_size=SCORE_PAGE_SIZE, padded_len=padded)
    caches = allocate_caches(cfg, num_pages=padded // SCORE_PAGE_SIZE, page_size=SCORE_PAGE_SIZE,
                             num_state_slots=1, dtype=model.dtype, tp_size=model.mixer_tp_size)
    if model.mesh is not None:
        caches = jax.device_put(caches, pool_shardings(caches, model.mesh, model.mixer_tp_size))
    out, _ = forward(model, caches, batch)
    return np.asarray(out.logits[: ids.size], dtype=np.float32)
