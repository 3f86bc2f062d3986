"""The one dispatch layer between models and kernels.

Models call these functions only. Each picks an implementation by backend:
- "reference": the pure-jnp oracles in `pallas_kernels/<op>/reference.py` (CPU, tests);
- "pallas": the Pallas kernels (GPU);
- "interpret": the Pallas kernels in interpret mode (CPU tests of the kernel path).
The default is "pallas" on GPU and "reference" elsewhere; `JSPEC_KERNELS` or `set_backend` override
it. An operation with no Pallas kernel yet falls back to its reference, so every backend is complete.
"""

from __future__ import annotations

import contextlib
import importlib
import os

import jax

from pallas_kernels.gdn import reference as gdn_ref
from pallas_kernels.moe import reference as moe_ref
from pallas_kernels.paged_attention import reference as attn_ref

BACKENDS = ("reference", "pallas", "interpret")
_backend: str | None = None


def default_backend() -> str:
    env = os.environ.get("JSPEC_KERNELS")
    if env:
        if env not in BACKENDS:
            raise ValueError(f"JSPEC_KERNELS={env!r}: must be one of {BACKENDS}")
        return env
    return "pallas" if jax.default_backend() == "gpu" else "reference"


def backend() -> str:
    return _backend or default_backend()


def set_backend(name: str | None) -> None:
    """Select the kernel backend for functions traced from now on (None: the default)."""
    global _backend
    if name is not None and name not in BACKENDS:
        raise ValueError(f"kernel backend must be one of {BACKENDS}, got {name!r}")
    _backend = name


@contextlib.contextmanager
def use_backend(name: str):
    prev = _backend
    set_backend(name)
    try:
        yield
    finally:
        set_backend(prev)


def _kernel(module: str, name: str):
    """The Pallas implementation `pallas_kernels.<module>.<name>`, or None if not there yet."""
    try:
        mod = importlib.import_module(f"pallas_kernels.{module}")
    except ImportError:
        return None
    return getattr(mod, name, None)


def _pick(module: str, name: str, ref):
    b = backend()
    if b == "reference":
        return ref, {}
    fn = _kernel(module, name)
    if fn is None:
        return ref, {}
    return fn, ({"interpret": True} if b == "interpret" else {})


# ----------------------------------------------------------------------------- paged attention


def write_kv(k_pages, v_pages, k_new, v_new, slot_mapping):
    fn, kw = _pick("paged_attention", "write_kv", attn_ref.write_kv)
    return fn(k_pages, v_pages, k_new, v_new, slot_mapping, **kw)


def paged_attention(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, *, sm_scale, mask_mode="causal",
                    custom_mask=None):
    fn, kw = _pick("paged_attention", "paged_attention", attn_ref.paged_attention)
    return fn(q, k_pages, v_pages, page_table, seq_lens, cu_q_lens, sm_scale=sm_scale, mask_mode=mask_mode,
              custom_mask=custom_mask, **kw)


def paged_decode(q, k_pages, v_pages, page_table, seq_lens, *, sm_scale):
    fn, kw = _pick("paged_attention", "paged_decode", attn_ref.paged_decode)
    return fn(q, k_pages, v_pages, page_table, seq_lens, sm_scale=sm_scale, **kw)


# ----------------------------------------------------------------------------- gated deltanet


def causal_conv1d(x, weight, conv_pool, cu_seqlens, slots, has_initial):
    fn, kw = _pick("gdn", "causal_conv1d", gdn_ref.causal_conv1d)
    return fn(x, weight, conv_pool, cu_seqlens, slots, has_initial, **kw)


def gated_delta_rule(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial, *, decode: bool):
    """decode=True promises one token per request (T == B): the recurrent kernel; else chunked."""
    name = "gated_delta_rule_decode" if decode else "gated_delta_rule"
    fn, kw = _pick("gdn", name, gdn_ref.gated_delta_rule)
    return fn(q, k, v, g, beta, state_pool, cu_seqlens, slots, has_initial, **kw)


def causal_conv1d_verify(x, weight, conv_pool, slots, parents):
    fn, kw = _pick("gdn", "causal_conv1d_verify", gdn_ref.causal_conv1d_verify)
    return fn(x, weight, conv_pool, slots, parents, **kw)


def gated_delta_rule_verify(q, k, v, g, beta, state_pool, slots, parents):
    fn, kw = _pick("gdn", "gated_delta_rule_verify", gdn_ref.gated_delta_rule_verify)
    return fn(q, k, v, g, beta, state_pool, slots, parents, **kw)


def gdn_commit(state_pool, conv_pool, conv_scratch, replay, slots, path, accepted):
    """replay: the verified tokens' (k, v, g, beta); path `[B, N]`: `gdn_ref.accepted_path`."""
    fn, kw = _pick("gdn", "commit", gdn_ref.commit)
    return fn(state_pool, conv_pool, conv_scratch, *replay, slots, path, accepted, **kw)


# ----------------------------------------------------------------------------- mixture of experts


def moe_gather(x, experts, weights, gate_up, down):
    """Routed experts of decode / verify batches: the expert-tiled gather kernels read each routed
    expert about once per tile of up to 16 of its (token, k) pairs.
    x [T, E], experts / weights [T, K], gate_up [X, E, 2I], down [X, I, E] -> [T, E]."""
    fn, kw = _pick("moe", "moe_gather", moe_ref.moe_gather)
    return fn(x, experts, weights, gate_up, down, **kw)
