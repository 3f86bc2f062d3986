"""`step_common.carry`: what a split speculative step hands from one part to the next. The pools
travel once, as buffers, and the target forward's logits once, as scratch["logits"] (its output's
own copy dropped: at a large vocabulary they are most of the carry's bytes); a step whose scratch
holds no separate logits keeps its forward output whole."""

from __future__ import annotations

import jax.numpy as jnp

from jspec.models.causal_lm import ForwardOutput
from jspec.runtime.step_inputs import DeviceState
from jspec.speculative.step_common import SpecStep, carry


def _step(scratch: dict) -> SpecStep:
    z = jnp.zeros((2,), jnp.int32)
    state = DeviceState(caches="kv", req_to_page=z, last_token=z, output_counts=z, prompt_mask=z, logit_bias_ids=z,
                        logit_bias_values=z, draft_caches="draft kv", spec_state={"h": z}, seq_lens=z)
    return SpecStep(bucket=None, page_size=4, state=state, x={}, req_to_page=z, slots=z, valid=z, l0=z,
                    page_table=z, sb=None, greedy=z, key_fn=None, last=z, target=None, drafter=None,
                    caches=state.caches, draft_caches=state.draft_caches, spec_state=state.spec_state, scratch=scratch)


def test_the_verify_logits_travel_once():
    logits = jnp.arange(24, dtype=jnp.float32).reshape(4, 6)  # [B * N, V]: B 2, N 2
    out = ForwardOutput(logits=logits, final_hidden=jnp.ones((4, 3)), aux_hidden=jnp.ones((4, 2, 3)))
    step = _step({"out": out, "logits": logits.reshape(2, 2, 6)})
    buffers, rest = carry(step)
    assert set(buffers) == {"state", "caches", "draft_caches", "spec_state"}
    assert buffers["caches"] == "kv" and "state" not in rest
    assert buffers["state"].caches is None and buffers["state"].draft_caches is None  # the pools once
    scratch = rest["scratch"]
    assert scratch["out"].logits is None and scratch["out"].aux_hidden is out.aux_hidden
    assert scratch["logits"].shape == (2, 2, 6)
    assert step.scratch["out"] is out and out.logits is logits  # the step's own scratch is left as it was


def test_a_forward_output_without_separate_logits_travels_whole():
    out = ForwardOutput(logits=jnp.ones((2, 6)), final_hidden=jnp.ones((2, 3)), aux_hidden=None)
    _, rest = carry(_step({"out": out}))
    assert rest["scratch"]["out"] is out
