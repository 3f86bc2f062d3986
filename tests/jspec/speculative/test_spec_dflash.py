"""DFLASH: the block drafter read from z-lab's format against a numpy reference written from the
raw tensors (context K/V from fc + hidden_norm of the target's layer outputs, a non-causal block,
the target's embedding and head), and the engine's greedy output equal to the target's alone,
synchronous (v1) and overlapped (v2), dense and hybrid targets, with bad configurations refused."""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jspec import Engine
from jspec.cache.pool import allocate_caches
from jspec.errors import ConfigError
from jspec.models import load_model
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.models.drafters import load_drafter
from jspec.speculative.dflash_step import draft_block
from tests.support import drafters as td
from tests.support import models as tm
from tests.support.engines import SPEC_BS4, check_no_leaks, generates
from tests.support.numpy_ref import read_tensors, rms, rope, swiglu, target_embed_head

PAGE = 4
C = 9  # context tokens; the block starts at position C
BLOCK = 4
IDS = tm.random_ids(C + 1, seed=17)

BASE = SPEC_BS4
PROMPTS = [tm.random_ids(n, seed=300 + n) for n in (5, 19, 1, 12)]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def models(tmp_path_factory, tiny_checkpoint):
    root = tmp_path_factory.mktemp("dflash")
    d = {k: str(root / k) for k in ("dflash", "dflash_next", "bigram", "agree")}
    d["qwen3"], d["qnext"] = tiny_checkpoint("qwen3", 41), tiny_checkpoint("qwen3_next", 5)
    td.write_dflash(d["dflash"], d["qwen3"], seed=5, target_layer_ids=[0], block_size=BLOCK)
    td.write_dflash(d["dflash_next"], d["qnext"], seed=6, target_layer_ids=[0, 2, 4], block_size=BLOCK, prefix="model.")
    # A drafter whose first draft the target mostly keeps, so acceptance past node 0 runs.
    tm.build("qwen3", d["bigram"], seed=42)
    td.make_block_bigram(d["bigram"])
    td.write_agreeing_dflash(d["agree"], d["bigram"], block_size=BLOCK)
    return d


# ----------------------------------------------------------------------------- the drafter


def dflash_reference(t, cfg, embed, head, ctx_streams, block_ids):
    """Logits `[BLOCK, V]` of a block at positions C.. after a context of C tokens whose
    captured target streams are ctx_streams `[C, n*E]`."""
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    h, g, d = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    c = rms(ctx_streams @ t["fc.weight"].T, t["hidden_norm.weight"], eps)
    x = embed[block_ids]
    n, m = len(block_ids), len(c)
    qpos, kpos = np.arange(m, m + n), np.arange(m + n)
    for i in range(cfg["num_hidden_layers"]):
        p = f"layers.{i}"
        hx = rms(x, t[f"{p}.input_layernorm.weight"], eps)
        q = (hx @ t[f"{p}.self_attn.q_proj.weight"].T).reshape(n, h, d)
        kv_in = np.concatenate([c, hx])  # the context is projected as is: no input norm
        k = (kv_in @ t[f"{p}.self_attn.k_proj.weight"].T).reshape(m + n, g, d)
        v = (kv_in @ t[f"{p}.self_attn.v_proj.weight"].T).reshape(m + n, g, d)
        q = rope(rms(q, t[f"{p}.self_attn.q_norm.weight"], eps), theta, qpos)
        k = rope(rms(k, t[f"{p}.self_attn.k_norm.weight"], eps), theta, kpos)
        k, v = np.repeat(k, h // g, axis=1), np.repeat(v, h // g, axis=1)
        s = np.einsum("qhd,khd->hqk", q, k) / np.sqrt(d)  # no mask: context and the whole block
        pr = np.exp(s - s.max(-1, keepdims=True))
        o = np.einsum("hqk,khd->qhd", pr / pr.sum(-1, keepdims=True), v).reshape(n, h * d)
        x = x + o @ t[f"{p}.self_attn.o_proj.weight"].T
        x = x + swiglu(rms(x, t[f"{p}.post_attention_layernorm.weight"], eps), t, f"{p}.mlp")
    return rms(x, t["norm.weight"], eps) @ head.T


@functools.partial(jax.jit, static_argnums=(0, 2))
def _context_and_block(dgd, dparams, tgd, tparams, cbatch, caches, hidden, first, start, page_table):
    drafter, target = nnx.merge(dgd, dparams), nnx.merge(tgd, tparams)
    caches = drafter.write_context(cbatch, caches, hidden)
    valid = jnp.ones((1,), bool)
    return draft_block(drafter, target, caches, first, start, valid, page_table, jnp.zeros((1,), jnp.int32), PAGE,
                       BLOCK - 1)


def _logits_of_block(dm, target, hidden, first):
    """The drafts of a block through the engine's path: context written to out-of-order pages
    (everything else NaN), then the block."""
    pages = [5, 1, 3, 0]
    pos = np.arange(C)
    slots = np.array([pages[p // PAGE] * PAGE + p % PAGE for p in pos])
    cbatch = ForwardBatch(
        input_ids=jnp.zeros((C,), jnp.int32), positions=jnp.asarray(pos, jnp.int32),
        seq_lens=jnp.asarray([C], jnp.int32), cu_q_lens=jnp.asarray([0, C], jnp.int32),
        page_table=jnp.asarray([pages], jnp.int32), slot_mapping=jnp.asarray(slots, jnp.int32),
        state_slots=jnp.zeros((1,), jnp.int32), has_initial_state=jnp.zeros((1,), bool), mode=ForwardMode.EXTEND)
    caches = allocate_caches(dm.config, num_pages=6, page_size=PAGE, num_state_slots=1, dtype=dm.dtype)
    caches = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.nan), caches)
    return _context_and_block(dm.graphdef, dm.params, target.graphdef, target.params, cbatch, caches,
                              jnp.asarray(hidden, jnp.float32), jnp.asarray([first], jnp.int32),
                              jnp.asarray([C], jnp.int32), jnp.asarray([pages], jnp.int32))


@pytest.mark.parametrize("name, tdir_key, ddir_key", [("qwen3", "qwen3", "dflash"), ("qwen3_next", "qnext", "dflash_next")])
def test_dflash_drafts_match_reference(models, name, tdir_key, ddir_key):
    import transformers

    tdir, ddir = models[tdir_key], models[ddir_key]
    target = load_model(tdir, dtype="float32")
    dm = load_drafter("DFLASH", ddir, target)
    with open(os.path.join(ddir, "config.json")) as f:
        cfg = json.load(f)
    layer_ids = cfg["dflash_config"]["target_layer_ids"]
    assert dm.block_size == BLOCK and dm.capture_layers == tuple(i + 1 for i in layer_ids)

    # The context: transformers' hidden_states[i + 1] (layer i's output) of the prompt, as z-lab reads them.
    hf = transformers.AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([IDS[:C]]), output_hidden_states=True).hidden_states
    streams = np.concatenate([hs[i + 1][0].double().numpy() for i in layer_ids], -1)

    t = read_tensors(ddir, strip="model.")
    embed, head = target_embed_head(tdir)
    mask = cfg["dflash_config"]["mask_token_id"]
    block = [IDS[C]] + [mask] * (BLOCK - 1)
    ref = dflash_reference(t, cfg, embed, head, streams, block)
    drafts, _ = _logits_of_block(dm, target, streams, IDS[C])
    np.testing.assert_array_equal(np.asarray(drafts)[0], np.argmax(ref[1:], axis=-1))
    # Margins: the reference's top-2 gap at each drafted row is far above float32 noise, so the
    # argmax comparison above is a real comparison of the logits.
    top2 = np.sort(ref[1:], axis=-1)[:, -2:]
    assert np.all(top2[:, 1] - top2[:, 0] > 1e-4)


def test_dflash_logits_match_reference(models):
    """The full logits, not only their argmax (the drafter called directly)."""
    import transformers

    tdir, ddir = models["qwen3"], models["dflash"]
    target = load_model(tdir, dtype="float32")
    dm = load_drafter("DFLASH", ddir, target)
    with open(os.path.join(ddir, "config.json")) as f:
        cfg = json.load(f)
    hf = transformers.AutoModelForCausalLM.from_pretrained(tdir, dtype=torch.float32).eval()
    with torch.no_grad():
        hs = hf(torch.tensor([IDS[:C]]), output_hidden_states=True).hidden_states
    streams = hs[1][0].double().numpy()
    t = read_tensors(ddir)
    embed, head = target_embed_head(tdir)
    block = [IDS[C]] + [cfg["dflash_config"]["mask_token_id"]] * (BLOCK - 1)
    ref = dflash_reference(t, cfg, embed, head, streams, block)

    drafter, tgt = nnx.merge(dm.graphdef, dm.params), nnx.merge(target.graphdef, target.params)
    caches = allocate_caches(dm.config, num_pages=4, page_size=PAGE, num_state_slots=1, dtype=dm.dtype)
    n = C + BLOCK
    pos = jnp.arange(n, dtype=jnp.int32)
    table = jnp.arange(4, dtype=jnp.int32)[None]

    def batch(ids, p, mode, tree=None):
        return ForwardBatch(input_ids=jnp.asarray(ids, jnp.int32), positions=p, seq_lens=jnp.asarray([int(p[-1]) + 1]),
                            cu_q_lens=jnp.asarray([0, len(ids)], jnp.int32), page_table=table, slot_mapping=p,
                            state_slots=jnp.zeros((1,), jnp.int32), has_initial_state=jnp.zeros((1,), bool),
                            tree_mask=tree, mode=mode)

    caches = drafter.write_context(batch([0] * C, pos[:C], ForwardMode.EXTEND), caches, jnp.asarray(streams, jnp.float32))
    out, _ = drafter(batch(block, pos[C:], ForwardMode.VERIFY, jnp.ones((1, BLOCK, BLOCK), bool)), caches, target=tgt)
    assert tm.rel_err(out.logits, ref) < 1e-4


def test_bad_dflash_configs(models, tmp_path):
    target = load_model(models["qwen3"], dtype="float32")

    def variant(name, **change):  # the module's drafter with its config.json changed
        return tm.variant(models["dflash"], str(tmp_path / name), config=lambda c: {**c, **change})

    with pytest.raises(ConfigError, match="target_layer_ids"):
        load_drafter("DFLASH", variant("deep", dflash_config={"mask_token_id": 3, "target_layer_ids": [1]}), target)
    with pytest.raises(ConfigError, match="mask_token_id"):
        load_drafter("DFLASH", variant("mask", dflash_config={"mask_token_id": 10 ** 6, "target_layer_ids": [0]}),
                     target)
    with pytest.raises(ConfigError, match="block_size"):
        load_drafter("DFLASH", variant("block", block_size=1), target)
    with pytest.raises(ConfigError, match="exceeds the DFlash drafter's block_size"):
        Engine(models["qwen3"], page_size=4, speculative_algorithm="DFLASH",
               speculative_draft_model_path=models["dflash"], speculative_num_draft_tokens=BLOCK + 1, **BASE)


# ----------------------------------------------------------------------------- the engine


# One engine case (CI time): acceptance past node 0, overlapped, a page per token. The hybrid
# target's DFlash context is checked against the reference above; its verify and commit are the
# shared path the EAGLE-family engine tests run on hybrid targets.
@pytest.mark.parametrize("tkey, dkey, page_size, overlap", [("bigram", "agree", 1, True)])
def test_dflash_greedy_equals_target(models, greedy_reference, tkey, dkey, page_size, overlap):
    ref = greedy_reference(models[tkey], PROMPTS, GREEDY, page_size=4, settings=BASE)
    eng = Engine(models[tkey], page_size=page_size, speculative_algorithm="DFLASH",
                 speculative_draft_model_path=models[dkey], disable_overlap_schedule=not overlap,
                 transfer_guard="disallow" if overlap else None, **BASE)
    try:
        assert eng.spec.num_draft_tokens == BLOCK and eng.spec.num_steps == BLOCK - 1  # the drafter's block
        outs = generates(eng, PROMPTS, GREEDY, ref)
        assert all(o["meta_info"]["spec_verify_ct"] > 0 for o in outs)
        accept = eng.get_server_info()["avg_spec_accept_length"]
        if dkey == "agree":  # the agreeing drafter: most blocks are kept whole, some cut short
            assert 1.5 < accept < BLOCK, accept
        check_no_leaks(eng)
    finally:
        eng.shutdown()
