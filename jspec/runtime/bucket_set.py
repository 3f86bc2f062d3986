"""Which steps an engine compiles: its bucket list, built once from the engine's settings.

Every shape a step can run at is a bucket (`step_inputs.Bucket`), compiled at start-up; a plan is
padded into the smallest bucket that holds it (`ModelRunner.bucket_for`). Decode buckets come per
batch size, in up to two sampler variants (the host knows whether any request needs top-k / top-p,
so that choice is static and no device-side conditional stalls dispatch) and, for a speculative
engine, in the variants its policy may switch between (the plain step, shorter draft chains).
Prompt-chunk buckets come per token count, optionally twice (with input-token logprobs).
"""

from __future__ import annotations

import dataclasses
import functools

from jspec.cache.pool import PoolLayout
from jspec.models.batch import ForwardMode
from jspec.runtime import split_step
from jspec.runtime.grammar import mask_words
from jspec.runtime.step import Drafting
from jspec.runtime.step_inputs import Bucket


def step_buckets(vocab_size: int, layout: PoolLayout, drafting: Drafting | None, *, decode_batch_sizes: list[int],
                 extend_token_sizes: list[int], max_extend_requests: int, top_k_top_p: bool = True,
                 plain_decode: bool = False, shorter_chains: bool = False, prefix_pages: int = 0,
                 grammar: bool = False, grammar_pipeline: bool = False, input_logprobs: bool = False) -> list[Bucket]:
    """The buckets of an engine, decode first (by batch size), then prompt chunks (by tokens).

    plain_decode / shorter_chains: a speculative engine also compiles each decode bucket's plain
    step / its drafter's shorter chains, which it runs when they pay better (runtime.adaptive);
    prefix_pages: cached pages a prompt step may map into page-table rows (prefix cache);
    grammar: every step takes token bitmasks; grammar_pipeline: constrained speculative steps run
    pipelined (`split_step`); input_logprobs: each prompt bucket also has a variant that reports them."""
    page_size = layout.page_size
    sorts = (False, True) if top_k_top_p else (False,)
    # A speculative step writes kv_ahead positions past each request's length.
    updates_per_req = 1 if drafting is None else -(-drafting.kv_ahead // page_size) + 1
    variants = [(True, 0)]
    if drafting is not None and plain_decode:
        variants.append((False, 0))
    if drafting is not None and shorter_chains:
        variants += [(True, k) for k in drafting.shorter_chains]
    words = mask_words(vocab_size) if grammar else 0
    masks = functools.partial(split_step.grammar_fields, words, drafting, pipeline=grammar_pipeline)
    buckets = []
    for b in sorted(set(decode_batch_sizes)):
        for sort in sorts:
            for speculate, steps in variants:
                buckets.append(Bucket(ForwardMode.DECODE, b, b, b * updates_per_req, sort=sort, speculate=speculate,
                                      draft_steps=steps, snapshots=layout.num_snapshots > 0,
                                      commit_tracks=drafting is not None, **masks(speculate, steps)))
    ahead_pages = 0 if drafting is None else -(-drafting.prefill_ahead // page_size)
    for t in sorted(set(extend_token_sizes)):
        b = min(t, max_extend_requests)
        updates = t // page_size + b * (1 + ahead_pages) + 1 + prefix_pages
        for lp in (False, True) if input_logprobs else (False,):
            # Without top-k / top-p no row needs the sort: compile none (neither the sort nor the
            # device-side conditional that would choose whether to run it).
            buckets.append(Bucket(ForwardMode.EXTEND, t, b, updates, sort=None if top_k_top_p else False,
                                  next_ids=drafting is not None and drafting.extend_next_ids,
                                  snapshots=layout.num_snapshots > 0, input_logprobs=lp,
                                  **masks(False, 0, decode=False)))
    return buckets


def sampler_twins(buckets: list[Bucket]) -> dict[Bucket, Bucket]:
    """{bucket: its twin} for each bucket that differs from another of `buckets` only in what its
    sampler computes (the top-k / top-p sort, input-token logprobs): the twin is the variant without
    them. Both run the same model forward, so their matmuls are the same."""
    present = set(buckets)
    twins = {}
    for b in buckets:
        twin = dataclasses.replace(b, sort=False if b.sort else b.sort, input_logprobs=False)
        if twin != b and twin in present:
            twins[b] = twin
    return twins
