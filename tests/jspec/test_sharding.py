"""Tensor-parallel layouts (`jspec.sharding`) without an engine: every parameter of every family
has a split rule; the shard-major layout of fused projections gives each device exactly its own
q/k/v (gate/up, conv channels) rows, replicating KV heads when there are fewer than devices; a
split that cannot work is a ConfigError naming the field before any weight is read; a split model
puts about 1/N of the weights on each device; a split model's forward (the Pallas kernels in
interpret mode, mapped per device) equals the unsplit one. The test session runs on 4 CPU devices
(tests/conftest.py)."""

from __future__ import annotations

import json
import os

import jax
import numpy as np
import pytest

from jspec import Engine
from jspec.config import load_config, parse_hf_config
from jspec.errors import ConfigError
from jspec.models import load_model
from jspec.models import dispatch, ops
from jspec.models.loader import abstract_model, flat_names, shard_model
from jspec.models.presets import preset_config
from jspec.sharding import (check_tp, from_tp_layout, kv_heads, padded_vocab, param_spec, split_shard_major,
                            to_tp_layout)
from tests.support import models as tm

FAMILIES = ("llama", "qwen3", "qwen3_moe", "qwen3_next", "qwen3_5", "qwen3_5_moe")


def test_four_cpu_devices():
    assert len(jax.devices()) >= 4, "tests/conftest.py forces 4 host devices for the tensor-parallel tests"


@pytest.mark.parametrize("family", FAMILIES)
def test_every_parameter_has_a_split_rule(tiny_checkpoint, family):
    cfg = load_config(tiny_checkpoint(family, 3))
    for tp in (1, 2):
        _, abstract = abstract_model(cfg, np.float32, tp)
        for name, shape in flat_names(abstract).items():
            spec = param_spec(name)
            for axis, part in enumerate(spec):
                if part is not None:
                    assert shape[axis] % tp == 0, (name, shape, spec)


@pytest.mark.parametrize("g,tp", [(2, 2), (4, 2), (2, 4), (1, 4)])
def test_fused_qkv_rows_are_shard_major_with_replicated_kv_heads(g, tp):
    """Device s's contiguous rows of the fused projection, split with `split_shard_major`, are the
    query heads s*H/tp.. and the KV head each of them reads (GQA: head h reads h // (H/G))."""
    h, d, e = 8, 4, 5
    cfg = parse_hf_config({**preset_config("tiny-llama"), "num_attention_heads": h, "num_key_value_heads": g,
                           "head_dim": d, "hidden_size": e})
    rng = np.random.default_rng(0)
    w = rng.standard_normal(((h + 2 * g) * d, e)).astype(np.float32)
    x = rng.standard_normal((2, e)).astype(np.float32)
    q_ref, k_ref, v_ref = np.split(x @ w.T, [h * d, (h + g) * d], axis=-1)
    w_tp = to_tp_layout("model.layers.0.self_attn.qkv_proj.weight", w, cfg, tp)
    g_tp = kv_heads(g, tp)
    assert w_tp.shape == ((h + 2 * g_tp) * d, e)
    q, k, v = (np.asarray(a) for a in split_shard_major(x @ w_tp.T, [h * d, g_tp * d, g_tp * d], tp))
    np.testing.assert_allclose(q, q_ref, rtol=1e-6)
    k, k_ref = k.reshape(2, g_tp, d), k_ref.reshape(2, g, d)
    for head in range(h):  # every query head finds its own KV head under the split's GQA grouping
        np.testing.assert_allclose(k[:, head // (h // g_tp)], k_ref[:, head // (h // g)], rtol=1e-6)
    rows_per_device = w_tp.shape[0] // tp
    for s in range(tp):  # device s holds its query heads' rows first
        np.testing.assert_array_equal(w_tp[s * rows_per_device: s * rows_per_device + h * d // tp],
                                      w[s * h * d // tp: (s + 1) * h * d // tp])
    assert v.shape[-1] == g_tp * d and v_ref.shape[-1] == g * d
    np.testing.assert_array_equal(from_tp_layout("model.layers.0.self_attn.qkv_proj.weight", w_tp, cfg, tp), w)


def test_gate_up_expert_and_conv_layouts_invert():
    cfg = parse_hf_config(preset_config("tiny-qwen3-next"))
    rng = np.random.default_rng(1)
    tp = 2
    gate_up = rng.standard_normal((2 * 8, 4)).astype(np.float32)
    parts = split_shard_major(to_tp_layout("model.layers.0.mlp.gate_up_proj.weight", gate_up, cfg, tp).T, [8, 8], tp)
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in parts], -1), gate_up.T)
    experts = rng.standard_normal((3, 4, 2 * 6)).astype(np.float32)
    parts = split_shard_major(to_tp_layout("model.layers.1.mlp.experts.gate_up_proj", experts, cfg, tp), [6, 6], tp)
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in parts], -1), experts)
    kd, vd = cfg.gdn_key_dim, cfg.gdn_value_dim
    conv = rng.standard_normal((2 * kd + vd, 1, 4)).astype(np.float32)
    conv_tp = to_tp_layout("model.layers.0.linear_attn.conv1d.weight", conv, cfg, tp)
    parts = split_shard_major(conv_tp[:, 0, :].T, [kd, kd, vd], tp)
    np.testing.assert_array_equal(np.concatenate([np.asarray(p) for p in parts], -1), conv[:, 0, :].T)
    embed = rng.standard_normal((cfg.vocab_size, 4)).astype(np.float32)
    padded = to_tp_layout("model.embed_tokens.weight", embed, cfg, 3)
    assert padded.shape[0] == padded_vocab(cfg.vocab_size, 3) and not padded[cfg.vocab_size:].any()


@pytest.mark.parametrize("family,changes,tp,match", [
    ("llama", {}, 8, "only 4 device"),
    ("llama", {"num_attention_heads": 6, "num_key_value_heads": 6, "head_dim": 16}, 4, "num_attention_heads=6"),
    ("llama", {"num_key_value_heads": 4, "num_attention_heads": 12, "head_dim": 8}, 3,
     "num_key_value_heads=4"),
    ("llama", {"intermediate_size": 98}, 4, "intermediate_size=98"),
    ("qwen3_moe", {"moe_intermediate_size": 30}, 4, "moe_intermediate_size=30"),
    ("qwen3_moe", {"num_experts": 6}, -4, "num_experts=6"),  # -4: tp_size 4 with ep_size 4
    ("qwen3_next", {}, 4, "linear_num_key_heads=2"),
    ("llama", {}, 0, "positive int"),
])
def test_impossible_splits_are_config_errors_before_loading(tmp_path, tiny_checkpoint, family, changes, tp, match):
    """The directory holds config.json only: the error must come before any tensor is read."""
    with open(os.path.join(tiny_checkpoint(family, 3), "config.json")) as f:
        raw = {**json.load(f), **changes}
    (tmp_path / "config.json").write_text(json.dumps(raw))
    ep = tp < 0
    tp = abs(tp)
    with pytest.raises(ConfigError, match=match):
        check_tp(load_config(tmp_path), tp, ep=ep)
    with pytest.raises(ConfigError, match=match):
        Engine(str(tmp_path), tp_size=tp, ep_size=tp if ep else None, dtype="float32", show_progress=False)


def test_a_split_model_must_match_tp_size(tiny_checkpoint):
    model = load_model(tiny_checkpoint("qwen3", 3), dtype="float32")
    split = shard_model(model, 2)
    with pytest.raises(ConfigError, match="split 2 ways"):
        Engine(split, tp_size=4, show_progress=False)
    with pytest.raises(ConfigError, match="unsplit"):
        shard_model(split, 4)
    with pytest.raises(ConfigError, match="ep_size=3 must be 1 or equal to tp_size=2"):
        Engine(tiny_checkpoint("qwen3", 3), tp_size=2, ep_size=3, show_progress=False)


def test_device_zero_holds_a_quarter_of_the_weights(tiny_checkpoint):
    """Loaded 4 ways straight from the safetensors files, device 0 holds about 1/4 of the
    weights (norms, the router and row-parallel biases are replicated; KV heads repeat). Counted
    over the model's own arrays: `jax.live_arrays()` is process-wide, and another test module's
    engine in this worker may allocate meanwhile."""
    path = tiny_checkpoint("qwen3_moe", 3)
    model = load_model(path, dtype="float32", tp_size=4)
    dev = jax.devices()[0]
    on_device0 = sum(s.data.nbytes for leaf in jax.tree.leaves(model.params) for s in leaf.addressable_shards
                     if s.device == dev)
    total = model.num_bytes()
    assert model.tp_size == 4 and total / 4 <= on_device0 < 0.3 * total, (on_device0, total)
    for leaf in jax.tree.leaves(model.params):
        assert len(leaf.sharding.device_set) == 4


@pytest.mark.parametrize("family,tp,ep", [("qwen3_next", 2, False), ("qwen3_5_moe", 2, False), ("llama", 4, False),
                                         ("qwen3_moe", 4, True)])
def test_split_forward_with_pallas_kernels_matches_unsplit(tiny_checkpoint, family, tp, ep):
    """Every kernel of the prompt path (q / k norm + rotary + KV write, gated and partly rotated for
    the hybrids; the two-part prompt attention, causal conv, chunked gated delta rule, MoE gather,
    with experts split by intermediate dimension or whole) in interpret mode under shard_map,
    against the unsplit reference forward."""
    path = tiny_checkpoint(family, 3)
    ids = tm.random_ids(21, seed=5)
    ref = load_model(path, dtype="float32").score(ids)
    split = load_model(path, dtype="float32", tp_size=tp, expert_parallel=ep)
    assert split.expert_parallel == ep
    with dispatch.use_backend("interpret"):
        got = split.score(ids)
    np.testing.assert_allclose(got, ref, rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("tp,vocab,backend", [(2, 64, "reference"), (4, 64, "reference"), (4, 62, "reference"),
                                              (2, 64, "interpret")])
def test_vocab_reductions_stay_on_each_device(tp, vocab, backend):
    """The sampler's reductions over a vocabulary-split row equal the unsplit ones, ties included
    (the lowest id wins): top-k (top logprobs; 20 of them over 17 rows, -inf entries among them,
    also through the Pallas kernel in interpret mode), argmax (greedy) and the Gumbel-max draw of
    `categorical` with the same keys; the compiled program moves only per-device candidates, as
    all-reduces, never an all-gather (NCCL's were the slow collective of a TP decode step); also
    where the padded columns of a vocabulary that does not divide by tp were dropped (62 of 64)."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jspec.runtime import sampler
    from jspec.sharding import TP, make_mesh

    rng = np.random.default_rng(tp)
    x = rng.integers(0, 6, (3, 64)).astype(np.float32)  # many ties
    wide = rng.integers(0, 6, (17, 160)).astype(np.float32)
    wide_vocab = 160 - (64 - vocab)
    wide[rng.random(wide.shape) < 0.5] = -np.inf
    keys = jax.vmap(sampler.row_key)(np.array([1, 2, 3], np.int32), np.array([0, 5, 9], np.int32))
    mesh = make_mesh(tp)
    xs, wides = (jax.device_put(a, NamedSharding(mesh, P(None, TP))) for a in (x, wide))
    with dispatch.tensor_parallel(mesh), dispatch.use_backend(backend):
        fn = jax.jit(lambda v, k, w: (ops.vocab_top_k(v[:, :vocab], 5, tp=tp), ops.vocab_argmax(v[:, :vocab], tp=tp),
                                      sampler.categorical(k, v[:, :vocab] / 3.0, tp=tp),
                                      ops.vocab_top_k(w[:, :wide_vocab], 20, tp=tp)))
        hlo = fn.lower(xs, keys, wides).compile().as_text()
        (vals, ids), best, drawn, (wide_vals, wide_ids) = fn(xs, keys, wides)
    for got, want in (((vals, ids), jax.lax.top_k(x[:, :vocab], 5)),
                      ((wide_vals, wide_ids), jax.lax.top_k(wide[:, :wide_vocab], 20))):
        np.testing.assert_array_equal(np.asarray(got[0]), np.asarray(want[0]))
        np.testing.assert_array_equal(np.asarray(got[1]), np.asarray(want[1]))
    np.testing.assert_array_equal(np.asarray(best), np.argmax(x[:, :vocab], axis=-1))
    np.testing.assert_array_equal(np.asarray(drawn), jax.vmap(jax.random.categorical)(keys, x[:, :vocab] / 3.0))
    gathers = [line for line in hlo.splitlines() if "all-gather" in line]
    assert not gathers, gathers[:1]


@pytest.mark.parametrize("tp,vocab", [(2, 64), (4, 62)])
def test_vocab_lookups_read_each_id_on_its_device(tp, vocab):
    """The embedding lookup over a row-split table, the read of each row's chosen entries and their
    write (`ops.vocab_embed`, `ops.vocab_take`, `ops.vocab_put`) equal `jnp.take` /
    `take_along_axis` / a scatter, at batch 1 too (where XLA's GPU partitioning of a plain gather
    collected the whole table), with ids in every slice and 2-D ids (training's [B, T]); the
    compiled programs move only all-reduces."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    from jspec.sharding import TP, make_mesh

    rng = np.random.default_rng(tp)
    table = rng.standard_normal((64, 8)).astype(np.float32)
    x = rng.standard_normal((3, 64)).astype(np.float32)
    mesh = make_mesh(tp)
    ts = jax.device_put(table, NamedSharding(mesh, P(TP, None)))
    xs = jax.device_put(x, NamedSharding(mesh, P(None, TP)))
    with dispatch.tensor_parallel(mesh):
        for ids in (np.array([vocab - 1]), np.array([0, 31, 33, vocab - 1]), np.array([[5, 40], [61 % vocab, 2]])):
            fn = jax.jit(lambda t, i: ops.vocab_embed(t, i, tp=tp))
            np.testing.assert_array_equal(np.asarray(fn(ts, ids)), table[ids])
            assert "all-gather" not in fn.lower(ts, ids).compile().as_text()
        for rows in (1, 3):
            ids = np.array([[vocab - 1, 0], [0, 1], [32, 31]][:rows])
            fn = jax.jit(lambda v, i: ops.vocab_take(v[:, :vocab], i, tp=tp))
            np.testing.assert_array_equal(np.asarray(fn(xs[:rows], ids)), np.take_along_axis(x[:rows], ids, axis=1))
            assert "all-gather" not in fn.lower(xs[:rows], ids).compile().as_text()
            # Written where they live: vocab_put equals a scatter, leading axes kept ([1, R, V]).
            vals = -np.arange(ids.size, dtype=np.float32).reshape(ids.shape) - 1
            put = jax.jit(lambda v, i, w: ops.vocab_put(v[None, :, :vocab], i[None], w[None], tp=tp))
            want = x[:rows, :vocab].copy()
            want[np.arange(rows)[:, None], ids] = vals
            np.testing.assert_array_equal(np.asarray(put(xs[:rows], ids, vals))[0], want)
            if vocab % tp == 0:  # else the result's uneven split is XLA's to lay out, with a gather
                assert "all-gather" not in put.lower(xs[:rows], ids, vals).compile().as_text()


def test_convert_for_a_split_restores_straight_to_the_devices(tmp_path, tiny_checkpoint):
    """`jspec convert --tp-size 2` stores the split layout: a tp 2 load restores every tensor from
    orbax onto the mesh (no host copy of the weights), a tp 1 load undoes the layout, and both
    score like the HF checkpoint."""
    from jspec.convert import convert_checkpoint
    from jspec.models.loader import read_params
    from jspec.sharding import make_mesh

    src = tiny_checkpoint("qwen3_next", 3)
    out = str(tmp_path / "tp2")
    assert convert_checkpoint(src, out, dtype="float32", progress=False, tp_size=2)["tp_size"] == 2
    cfg = load_config(out)
    params, _, placed = read_params(out, cfg, np.float32, mesh=make_mesh(2))
    assert placed and all(isinstance(a, jax.Array) and len(a.sharding.device_set) == 2 for a in params.values())
    ids = tm.random_ids(17, seed=9)
    want = load_model(src, dtype="float32").score(ids)
    for tp in (2, 1):
        np.testing.assert_allclose(load_model(out, dtype="float32", tp_size=tp).score(ids), want, rtol=1e-4, atol=1e-4)


def test_replicated_attention_layouts(tmp_path, tiny_checkpoint):
    """`replicate_attention`: head counts that tp_size does not divide are no error (the mixers are
    not split); `jspec convert --replicate-attention` stores that layout, which restores straight
    onto the mesh at the same split and loads through the host at another; a model passed in must
    match the engine's setting."""
    from jspec.convert import convert_checkpoint
    from jspec.models.loader import read_params
    from jax.sharding import PartitionSpec as P

    from jspec.sharding import make_mesh

    src = tiny_checkpoint("qwen3_next", 3)
    cfg = load_config(src)
    with pytest.raises(ConfigError, match="linear_num_key_heads=2"):
        check_tp(cfg, 4)
    assert check_tp(cfg, 4, replicate_attention=True) == 4
    assert param_spec("model.layers.0.linear_attn.out_proj.weight", replicate_attention=True) == P()
    assert param_spec("model.layers.0.mlp.shared_expert.down_proj.weight", replicate_attention=True) == P(None, "tp")

    out = str(tmp_path / "tp4rep")
    meta = convert_checkpoint(src, out, dtype="float32", progress=False, tp_size=4, replicate_attention=True)
    assert meta["tp_size"] == 4 and meta["replicate_attention"]
    params, _, placed = read_params(out, cfg, np.float32, mesh=make_mesh(4), replicate_attention=True)
    assert placed
    ids = tm.random_ids(17, seed=9)
    want = load_model(src, dtype="float32").score(ids)
    for tp, rep in ((4, True), (2, False), (1, False)):
        got = load_model(out, dtype="float32", tp_size=tp, replicate_attention=rep)
        assert got.replicate_attention == rep
        np.testing.assert_allclose(got.score(ids), want, rtol=1e-4, atol=1e-4)
    split = shard_model(load_model(src, dtype="float32"), 2, replicate_attention=True)
    with pytest.raises(ConfigError, match="replicate_attention=True"):
        Engine(split, replicate_attention=False, show_progress=False)
