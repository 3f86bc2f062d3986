"""A step traces each Pallas kernel once, not once per layer (`jspec.models.dispatch.shared`): every
layer calls the kernel through one jitted function with the same shapes, so the step's jaxpr
holds one kernel jaxpr shared by all the calls, and JAX lowers that shared jaxpr once per step.
With 36 layers that is most of a GPU engine's trace-and-lower time at start-up."""

from __future__ import annotations

import collections
import dataclasses

import jax
import jax.numpy as jnp

from jspec.cache.pool import PoolLayout
from jspec.config import parse_hf_config
from jspec.models import dispatch
from jspec.models.loader import random_model
from jspec.models.presets import preset_config
from jspec.runtime.model_runner import ModelRunner
from jspec.runtime.step_inputs import ForwardMode

LAYERS = 4
KERNELS = ("add_rms_norm", "norm_rope_write", "write_kv", "paged_decode", "paged_attention", "prefill_attention")


def _eqns(jaxpr):
    """Every equation of a jaxpr and of the jaxprs nested in its equations' parameters."""
    for eqn in jaxpr.eqns:
        yield eqn
        for p in eqn.params.values():
            for sub in p if isinstance(p, (tuple, list)) else (p,):
                inner = getattr(sub, "jaxpr", sub)
                if hasattr(inner, "eqns"):
                    yield from _eqns(inner)


def test_each_kernel_is_traced_once_per_step():
    cfg = parse_hf_config(preset_config("tiny-qwen3"))
    cfg = dataclasses.replace(cfg, num_hidden_layers=LAYERS, layer_types=("full_attention",) * LAYERS,
                              moe_layers=(False,) * LAYERS)
    model = random_model(cfg, dtype="float32", seed=0)
    layout = PoolLayout(page_size=4, num_pages=16, num_slots=3, pages_per_seq=8)
    runner = ModelRunner(model, layout=layout, decode_batch_sizes=[2], extend_token_sizes=[8],
                         max_extend_requests=2, progress=False, compile=False)
    state = runner._abstract_state(layout)
    for bucket in runner.buckets:
        packed = jax.ShapeDtypeStruct((bucket.size,), jnp.int32)
        with dispatch.use_backend("interpret"):
            jaxpr = jax.make_jaxpr(runner.step_fn(bucket))(runner.params, state, packed)
        calls = collections.defaultdict(list)
        for eqn in _eqns(jaxpr.jaxpr):
            if eqn.primitive.name in ("pjit", "jit") and eqn.params.get("name") in KERNELS:
                calls[eqn.params["name"]].append(eqn.params["jaxpr"])
        # Prompt chunks take the two-part prefill attention (its jnp stand-in for cuDNN in interpret mode).
        want = {"add_rms_norm", "norm_rope_write", "paged_decode" if bucket.mode is ForwardMode.DECODE
                else "prefill_attention"}
        assert set(calls) == want, (bucket.label, dict(calls))
        for name, jaxprs in calls.items():
            per_layer = 2 if name == "add_rms_norm" else 1  # before the mixer and before the MLP
            # The first layer's norm has no delta to add: one trace of its own.
            traces = 2 if name == "add_rms_norm" else 1
            assert len(jaxprs) == per_layer * LAYERS and len({id(j) for j in jaxprs}) == traces, (bucket.label, name)
