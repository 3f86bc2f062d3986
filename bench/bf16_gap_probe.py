"""How far a bf16 forward is from float32, per kernel family, on a random Qwen3-Next-shaped model.

Pallas kernels and the XLA reference are each compared with a float32 XLA forward of the same
weights (200 random tokens, 4 layers, 64 experts): the XLA reference in bf16, then the Pallas
kernels of one family at a time (paged attention, GDN, MoE) and all together. Prints max abs logit
error and argmax agreement. One GPU.

    PYTHONPATH=. python3 bench/bf16_gap_probe.py
"""
import numpy as np
from jspec.config import parse_hf_config
from jspec.models import dispatch
from jspec.models.loader import random_model, state_to_flat, fill_state, abstract_model
from jspec.models.presets import preset_config
from jspec.models.scoring import jitted_forward
import dataclasses, jax.numpy as jnp
orig = dispatch.kernel
cfg = parse_hf_config({**preset_config("qwen3-next-12l"), "num_hidden_layers": 4, "num_experts": 64})
model = random_model(cfg, dtype="bfloat16", seed=1)
# the same weights in float32 for an fp32 XLA reference
flat = {k: np.asarray(v, np.float32) for k, v in state_to_flat(model.params).items()}
gd, ab = abstract_model(cfg, jnp.float32)
m32 = dataclasses.replace(model, graphdef=gd, params=fill_state(ab, flat, jnp.float32), dtype=jnp.dtype(jnp.float32))
ids = list(np.random.default_rng(3).integers(0, cfg.vocab_size, 200))
with dispatch.use_backend("reference"):
    jitted_forward.cache_clear(); ref32 = m32.score(ids)
    jitted_forward.cache_clear(); ref16 = model.score(ids)
def cmp(name, got):
    print(name, "max abs vs fp32", float(np.abs(got - ref32).max()), "argmax agree fp32", float((got.argmax(-1) == ref32.argmax(-1)).mean()), "ref max", float(np.abs(ref32).max()), flush=True)
cmp("xla-ref bf16", ref16)
for only in ("paged_attention", "gdn", "moe", "all"):
    dispatch.kernel = (lambda m, n, only=only: orig(m, n) if only in (m, "all") else None)
    jitted_forward.cache_clear()
    with dispatch.use_backend("pallas"):
        got = model.score(ids)
    dispatch.kernel = orig
    cmp("pallas bf16 " + only, got)
