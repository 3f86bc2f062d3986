"""EAGLE, EAGLE3 and MTP drafters loaded from their published formats, against references written
from the raw checkpoint tensors: numpy for the EAGLE heads (dense causal attention, RoPE, SwiGLU,
spelled out here), a one-layer transformers model of the target family for the MTP layer.

Each drafter runs as the engine runs it: jitted, through its paged KV cache (pages out of order,
everything unowned poisoned with NaN), an extend over 7 tokens then a decode at position 7, fed
with hidden states from the jspec target.
"""

from __future__ import annotations

import functools
import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from safetensors.numpy import load_file, save_file

from jspec.cache.pool import allocate_caches
from jspec.errors import CheckpointError, ConfigError, UnsupportedModelError
from jspec.models import load_model
from jspec.models.batch import ForwardBatch, ForwardMode
from jspec.models.drafters import DraftOutput, dflash_block_size, drafter_config, load_drafter, random_drafter
from jspec.models.scoring import forward, single_sequence_batch
from tests.support import drafters as td
from tests.support import models as tm
from tests.support.models import rel_err, variant
from tests.support.numpy_ref import causal_attention, read_tensors, rms, swiglu, target_embed_head

TOL = 1e-4
N = 7  # tokens of the extend step; the decode step is at position N
PAGE = 4
PAGES = [4, 2]  # the request's pages, out of order
IDS = tm.random_ids(N + 1, seed=3)


# ----------------------------------------------------------------------------- running a drafter


@functools.partial(jax.jit, static_argnums=(0, 2))
def _draft(dgd, dparams, tgd, tparams, batch, caches, hidden, idx):
    drafter, target = nnx.merge(dgd, dparams), nnx.merge(tgd, tparams)
    return drafter(batch, caches, hidden, target=target, logits_indices=idx)


def _batch(ids, start: int, mode: ForwardMode, num_tokens: int) -> ForwardBatch:
    """One request at positions start .. start+len(ids)-1, padded to num_tokens (slot -1)."""
    n = len(ids)
    pos = np.arange(start, start + n)
    slots = np.array([PAGES[p // PAGE] * PAGE + p % PAGE for p in pos])
    pad = num_tokens - n
    return ForwardBatch(
        input_ids=jnp.asarray(list(ids) + [0] * pad, jnp.int32),
        positions=jnp.asarray(list(pos) + [0] * pad, jnp.int32),
        seq_lens=jnp.asarray([start + n], jnp.int32), cu_q_lens=jnp.asarray([0, n], jnp.int32),
        page_table=jnp.asarray([PAGES + [0]], jnp.int32),
        slot_mapping=jnp.asarray(list(slots) + [-1] * pad, jnp.int32),
        state_slots=jnp.zeros((1,), jnp.int32), has_initial_state=jnp.zeros((1,), bool), mode=mode,
    )


def run_drafter(dm, target, hidden_ext, hidden_dec=None):
    """Extend over IDS[:N] with hidden_ext [N, Hin] (padded to 8 rows), then decode IDS[N] at
    position N with hidden_dec [1, *] (default: the extend's last DraftOutput.hidden)."""
    caches = allocate_caches(dm.config, num_pages=6, page_size=PAGE, num_state_slots=1, dtype=dm.dtype)
    caches = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.nan), caches)
    h = jnp.concatenate([hidden_ext, jnp.zeros((1, hidden_ext.shape[1]), hidden_ext.dtype)])
    ext, caches = _draft(dm.graphdef, dm.params, target.graphdef, target.params, _batch(IDS[:N], 0, ForwardMode.EXTEND, N + 1),
                         caches, h, jnp.arange(N))
    assert isinstance(ext, DraftOutput) and ext.logits.dtype == jnp.float32
    hd = ext.hidden[N - 1:] if hidden_dec is None else hidden_dec
    dec, _ = _draft(dm.graphdef, dm.params, target.graphdef, target.params, _batch(IDS[N:], N, ForwardMode.DECODE, 1),
                    caches, hd, None)
    return ext, dec


def target_out(target, capture_layers=()):
    """The jspec target over IDS (all N + 1 rows)."""
    batch = single_sequence_batch(IDS, page_size=16, padded_len=16)
    caches = allocate_caches(target.config, num_pages=1, page_size=16, num_state_slots=1, dtype=target.dtype)
    out, _ = forward(target, caches, batch, jnp.arange(N + 1), capture_layers)
    return out


# ----------------------------------------------------------------------------- numpy reference


def eagle_reference(t, cfg, embed, head, h):
    """EAGLE over IDS[:len(h)]: (logits, hidden) per row."""
    e = embed[IDS[: len(h)]]
    z = np.concatenate([e, h], -1) @ t["fc.weight"].T + t.get("fc.bias", 0.0)
    r = z + causal_attention(z, t, "layers.0.self_attn", cfg)
    out = r + swiglu(rms(r, t["layers.0.post_attention_layernorm.weight"], cfg["rms_norm_eps"]), t, "layers.0.mlp")
    return out @ head.T, out


def eagle3_reference(t, cfg, embed, hin):
    """EAGLE3 midlayer over IDS[:len(hin)] with the fc-folded (or fed-back) hidden hin [T, E]."""
    eps = cfg["rms_norm_eps"]
    e = embed[IDS[: len(hin)]]
    x = np.concatenate([rms(e, t["midlayer.input_layernorm.weight"], eps),
                        rms(hin, t["midlayer.hidden_norm.weight"], eps)], -1)
    r = hin + causal_attention(x, t, "midlayer.self_attn", cfg)
    s = r + swiglu(rms(r, t["midlayer.post_attention_layernorm.weight"], eps), t, "midlayer.mlp")
    return rms(s, t["norm.weight"], eps) @ t["lm_head.weight"].T, s


# ----------------------------------------------------------------------------- fixtures


def _target_dir(root, tiny_checkpoint, name, with_mtp=False):
    if not with_mtp:
        return tiny_checkpoint(name, len(name))
    d = os.path.join(root, name + "_mtp")
    tm.build(name, d, seed=len(name))
    td.add_mtp(d, seed=11)
    return d


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("drafters"))


@pytest.fixture(scope="module")
def targets(root, tiny_checkpoint):
    """name -> (dir, jspec target model); the MTP ones carry `mtp.*`."""
    out = {}
    for name, mtp in (("llama", False), ("qwen3", False), ("qwen3_next", True), ("qwen3_5", True)):
        d = _target_dir(root, tiny_checkpoint, name, mtp)
        out[name] = (d, load_model(d, dtype="float32"))
    return out


# ----------------------------------------------------------------------------- EAGLE


@pytest.mark.parametrize("case", [
    dict(target="llama", embed=True, bias=True, prefix=""),  # EAGLE v1: own embedding, fc bias
    dict(target="qwen3", embed=False, bias=False, prefix="model."),  # target's (tied) embedding, prefixed names
])
def test_eagle(targets, root, case):
    tdir, target = targets[case["target"]]
    d = os.path.join(root, f"eagle_{case['target']}")
    cfg = td.write_eagle(d, tdir, seed=1, embed=case["embed"], bias=case["bias"], prefix=case["prefix"])
    dm = load_drafter("EAGLE", d, target)
    assert dm.kind == "eagle" and dm.capture_layers == () and dm.config.attention_layer_ids == (0,)
    out = target_out(target)
    h = dm.module().target_hidden(out)  # the final normed hidden [N+1, E]
    np.testing.assert_array_equal(np.asarray(h), np.asarray(out.final_hidden))
    ext, dec = run_drafter(dm, target, h[:N], h[N:])

    t = read_tensors(d, strip=case["prefix"])
    embed, head = target_embed_head(tdir)
    embed = t.get("embed_tokens.weight", embed)
    logits, hid = eagle_reference(t, cfg, embed, head, np.asarray(h, np.float64))
    assert rel_err(ext.logits, logits[:N]) < TOL and rel_err(ext.hidden, hid[:N]) < TOL
    assert rel_err(dec.logits, logits[N:]) < TOL and rel_err(dec.hidden, hid[N:]) < TOL


# ----------------------------------------------------------------------------- EAGLE3


@pytest.mark.parametrize("case", [
    dict(target="llama", draft_vocab=None, aux=None, capture=(0, 1, 2)),  # SGLang's default ids, clipped
    dict(target="qwen3", draft_vocab=50, aux=[0, 1], capture=(1, 2)),  # reduced vocabulary, two aux layers
])
def test_eagle3(targets, root, case):
    tdir, target = targets[case["target"]]
    d = os.path.join(root, f"eagle3_{case['target']}")
    cfg = td.write_eagle3(d, tdir, seed=2, draft_vocab=case["draft_vocab"], aux_layer_ids=case["aux"])
    dm = load_drafter("EAGLE3", d, target)
    assert dm.kind == "eagle3" and dm.capture_layers == case["capture"]
    out = target_out(target, dm.capture_layers)
    # The captured streams are transformers' hidden_states[i] (the stream entering layer i).
    hf = getattr(__import__("transformers"), tm.SPECS[case["target"]][1]).from_pretrained(tdir).eval()
    import torch

    with torch.no_grad():
        hs = hf(torch.tensor([IDS]), output_hidden_states=True).hidden_states
    for j, layer in enumerate(dm.capture_layers):
        if layer < target.config.num_hidden_layers:  # the last entry of hidden_states is normed in HF
            assert rel_err(out.aux_hidden[:, j], hs[layer][0].numpy()) < TOL
    h = dm.module().target_hidden(out)  # [N+1, n*E]
    assert h.shape == (N + 1, len(case["capture"]) * cfg["hidden_size"])
    # Extend from the target's streams; the decode step feeds back the extend's own hidden [1, E].
    ext, dec = run_drafter(dm, target, h[:N])

    t = read_tensors(d)
    embed, _ = target_embed_head(tdir)
    hin = np.asarray(h, np.float64) @ t["fc.weight"].T
    logits, s = eagle3_reference(t, cfg, embed, hin[:N])
    assert rel_err(ext.logits, logits) < TOL and rel_err(ext.hidden, s) < TOL
    logits2, s2 = eagle3_reference(t, cfg, embed, np.concatenate([hin[:N], s[N - 1:]]))
    assert rel_err(dec.logits, logits2[N:]) < TOL and rel_err(dec.hidden, s2[N:]) < TOL

    vd = cfg["draft_vocab_size"]
    assert ext.logits.shape == (N, vd) and dm.module().draft_vocab_size == vd
    mapped = np.asarray(dm.module().to_target_ids(jnp.arange(vd, dtype=jnp.int32)))
    np.testing.assert_array_equal(mapped, np.nonzero(t["t2d"])[0])  # the hot ids, in order
    np.testing.assert_array_equal(mapped, np.arange(vd) + t["d2t"].astype(np.int64))


# ----------------------------------------------------------------------------- MTP


def hf_mtp_reference(name, tdir, h):
    """The MTP head with transformers: pre-fc norms and fc in torch, then a one-layer model of the
    target family whose only (full-attention) layer, final norm, embedding and lm_head are the
    MTP layer's and the target's. Returns (logits, normed hidden) per row of IDS[:len(h)]."""
    import torch
    import transformers

    cfg_cls, model_cls, kw = tm.SPECS[name]
    kw = dict(kw, num_hidden_layers=1, layer_types=["full_attention"])
    if "mlp_only_layers" in kw:
        kw["mlp_only_layers"] = []
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(vocab_size=tm.VOCAB, **kw)).eval()
    t = read_tensors(tdir)
    state = {k.replace("mtp.layers.0.", "model.layers.0."): torch.tensor(v, dtype=torch.float32)
             for k, v in t.items() if k.startswith("mtp.layers.0.") and ".mlp.experts." not in k}
    experts = sorted({int(k.split(".")[5]) for k in t if k.startswith("mtp.layers.0.mlp.experts.")})
    if experts:
        ex = "mtp.layers.0.mlp.experts"
        state["model.layers.0.mlp.experts.gate_up_proj"] = torch.tensor(np.stack(
            [np.concatenate([t[f"{ex}.{j}.gate_proj.weight"], t[f"{ex}.{j}.up_proj.weight"]]) for j in experts]),
            dtype=torch.float32)
        state["model.layers.0.mlp.experts.down_proj"] = torch.tensor(
            np.stack([t[f"{ex}.{j}.down_proj.weight"] for j in experts]), dtype=torch.float32)
    state["model.norm.weight"] = torch.tensor(t["mtp.norm.weight"], dtype=torch.float32)
    state["model.embed_tokens.weight"] = torch.tensor(t["model.embed_tokens.weight"], dtype=torch.float32)
    if "lm_head.weight" in model.state_dict():
        state["lm_head.weight"] = torch.tensor(t.get("lm_head.weight", t["model.embed_tokens.weight"]),
                                               dtype=torch.float32)
    model.load_state_dict(state, strict=True)

    eps = model.config.rms_norm_eps
    e = rms(t["model.embed_tokens.weight"][IDS[: len(h)]], t["mtp.pre_fc_norm_embedding.weight"], eps, True)
    hh = rms(np.asarray(h, np.float64), t["mtp.pre_fc_norm_hidden.weight"], eps, True)
    z = torch.tensor(np.concatenate([e, hh], -1) @ t["mtp.fc.weight"].T, dtype=torch.float32)[None]
    with torch.no_grad():
        s = model.model(inputs_embeds=z, use_cache=False).last_hidden_state
        logits = model.lm_head(s)
    return logits[0].numpy(), s[0].numpy()


@pytest.mark.parametrize("name", ["qwen3_next", "qwen3_5"])  # MoE + untied head; dense + tied
def test_mtp(targets, name):
    tdir, target = targets[name]
    assert any(k.startswith("mtp.") for k in target.extras)  # the target loader set them aside
    dm = load_drafter("NEXTN", tdir, target)
    assert dm.kind == "mtp" and dm.capture_layers == ()
    assert dm.config.attention_layer_ids == (0,) and dm.config.gdn_layer_ids == ()
    assert dm.config.moe_layers == ((name == "qwen3_next"),)
    out = target_out(target)
    h = dm.module().target_hidden(out)
    ext, dec = run_drafter(dm, target, h[:N], h[N:])
    logits, s = hf_mtp_reference(name, tdir, h)
    assert rel_err(ext.logits, logits[:N]) < TOL and rel_err(ext.hidden, s[:N]) < TOL
    assert rel_err(dec.logits, logits[N:]) < TOL and rel_err(dec.hidden, s[N:]) < TOL


def test_mtp_from_sharded_target_with_index(root):
    """add_mtp on a sharded target updates its index; the MTP layer loads from it."""
    d = os.path.join(root, "qwen3_5_sharded")
    tm.build("qwen3_5", d, seed=4, max_shard_size="60KB")
    td.add_mtp(d, seed=5)
    with open(os.path.join(d, td.INDEX)) as f:
        assert json.load(f)["weight_map"]["mtp.fc.weight"] == td.MTP_SHARD
    target = load_model(d, dtype="float32")
    dm = load_drafter("NEXTN", d, target)
    fc = dict(dm.params.flat_state())[("fc", "weight")].get_value()
    np.testing.assert_array_equal(np.asarray(fc), load_file(os.path.join(d, td.MTP_SHARD))["mtp.fc.weight"])


def test_mtp_from_converted_target(targets, root):
    """`jspec convert` keeps `mtp.*`; NEXTN reads them from the orbax directory alike."""
    from jspec.convert import convert_checkpoint

    src, target = targets["qwen3_next"]
    out = os.path.join(root, "qwen3_next_orbax")
    convert_checkpoint(src, out, dtype="float32", progress=False)
    a = load_drafter("NEXTN", out, load_model(out, dtype="float32"))
    b = load_drafter("NEXTN", src, target)
    fa, fb = dict(a.params.flat_state()), dict(b.params.flat_state())
    assert fa.keys() == fb.keys()
    for k in fa:
        np.testing.assert_array_equal(np.asarray(fa[k].get_value()), np.asarray(fb[k].get_value()))


# ----------------------------------------------------------------------------- random drafters


def _shapes(dm):
    return {path: leaf.get_value().shape for path, leaf in dm.params.flat_state()}


def test_random_drafters(targets, root):
    """Random drafters have the loaded ones' structure, for the same shapes (so the forwards
    tested above are theirs); a reduced vocabulary maps to distinct, sorted target ids."""
    head = dict(intermediate_size=80, num_attention_heads=4, num_key_value_heads=2, head_dim=16)
    tdir, target = targets["qwen3"]
    td.write_eagle(os.path.join(root, "r_eagle"), tdir, embed=False, bias=False)
    td.write_eagle3(os.path.join(root, "r_eagle3"), tdir, draft_vocab=50, aux_layer_ids=[0, 1])
    cases = [("EAGLE", "r_eagle", target, head), ("EAGLE3", "r_eagle3", target,
                                                  dict(head, draft_vocab_size=50, aux_layer_ids=[0, 1])),
             ("NEXTN", targets["qwen3_next"][0], targets["qwen3_next"][1], {})]
    for kind, d, tgt, shape in cases:
        rand = random_drafter(kind, tgt, "float32", seed=1, **shape)
        loaded = load_drafter(kind, os.path.join(root, d), tgt)
        assert _shapes(rand) == _shapes(loaded), kind
        assert rand.capture_layers == loaded.capture_layers and rand.kind == loaded.kind
    rand = random_drafter("EAGLE3", target, "float32", draft_vocab_size=40, **head)
    mapped = np.asarray(rand.module().to_target_ids(jnp.arange(40, dtype=jnp.int32)))
    assert mapped.shape == (40,) and np.all(np.diff(mapped) > 0) and mapped.max() < target.config.vocab_size
    with pytest.raises(ConfigError, match="draft_vocab_size"):
        random_drafter("EAGLE", target, "float32", draft_vocab_size=40)
    with pytest.raises(ConfigError, match="NEXTN"):
        random_drafter("NEXTN", target, "float32")


# ----------------------------------------------------------------------------- validation


@pytest.fixture(scope="module")
def eagle3_dir(targets, root):
    d = os.path.join(root, "eagle3_errors")
    td.write_eagle3(d, targets["llama"][0], seed=3, draft_vocab=50)
    return d


def _drop(name):
    return lambda t: {k: v for k, v in t.items() if k != name}


def _set(name, value):
    return lambda t: {**t, name: value}


ERRORS = [
    ("hidden", dict(config=lambda c: {**c, "hidden_size": 32}), ConfigError, "hidden_size"),
    ("target_hidden", dict(config=lambda c: {**c, "target_hidden_size": 32}), ConfigError, "target_hidden_size"),
    ("vocab", dict(config=lambda c: {**c, "vocab_size": 90}), ConfigError, "vocab_size"),
    ("draft_vocab", dict(config=lambda c: {**c, "draft_vocab_size": 200}), ConfigError, "draft_vocab_size"),
    ("aux_ids", dict(config=lambda c: {**c, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 5]}}),
     ConfigError, "eagle_aux_hidden_state_layer_ids"),
    ("aux_one", dict(config=lambda c: {**c, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0]}}),
     ConfigError, "at least two"),
    ("arch", dict(config=lambda c: {**c, "architectures": ["MistralForCausalLM"]}), ConfigError, "architectures"),
    ("fc_width", dict(tensors=lambda t: {**t, "fc.weight": t["fc.weight"][:, :128]}), CheckpointError, "'fc.weight'"),
    ("d2t_len", dict(tensors=lambda t: {**t, "d2t": t["d2t"][:49]}), CheckpointError, "'d2t'"),
    ("d2t_range", dict(tensors=lambda t: {**t, "d2t": t["d2t"] + 60}), CheckpointError, "'d2t'"),
    ("d2t_missing", dict(tensors=_drop("d2t")), CheckpointError, "'d2t'"),
    ("missing", dict(tensors=_drop("midlayer.self_attn.k_proj.weight")), CheckpointError,
     "'midlayer.self_attn.k_proj.weight'"),
    ("missing_norm", dict(tensors=_drop("norm.weight")), CheckpointError, "'norm.weight'"),
    ("missing_head", dict(tensors=_drop("lm_head.weight")), CheckpointError, "'lm_head.weight'"),  # Vd < V
    ("unexpected", dict(tensors=_set("midlayer.extra.weight", np.zeros(3, np.float32))), CheckpointError,
     "'midlayer.extra.weight'"),
    ("shape", dict(tensors=lambda t: {**t, "midlayer.mlp.down_proj.weight": t["midlayer.mlp.down_proj.weight"].T}),
     CheckpointError, "'midlayer.mlp.down_proj.weight'"),
]


@pytest.mark.parametrize("label, change, error, needle", ERRORS, ids=[e[0] for e in ERRORS])
def test_eagle3_errors(targets, eagle3_dir, root, label, change, error, needle):
    d = variant(eagle3_dir, os.path.join(root, f"bad_{label}"), **change)
    with pytest.raises(error) as info:
        load_drafter("EAGLE3", d, targets["llama"][1])
    assert needle in str(info.value), str(info.value)


def test_eagle3_borrowed_head(targets, root):
    """Without its own lm_head (and with the full vocabulary) EAGLE3 uses the target's, as SGLang's
    load_lm_head_from_target; its own embed_tokens, when shipped, replaces the target's."""
    tdir, target = targets["llama"]
    d = os.path.join(root, "eagle3_borrowed")
    td.write_eagle3(d, tdir, seed=5, embed=True)
    d = variant(d, os.path.join(root, "eagle3_borrowed_nohead"), tensors=_drop("lm_head.weight"))
    m = load_drafter("EAGLE3", d, target).module()
    assert m.lm_head is None and m.embed_tokens is not None and m.d2t is not None


def test_eagle_errors(targets, root):
    tdir, target = targets["llama"]
    good = os.path.join(root, "eagle_errors")
    td.write_eagle(good, tdir, seed=4, prefix="model.")
    d = variant(good, os.path.join(root, "eagle_missing"), tensors=_drop("model.layers.0.mlp.up_proj.weight"))
    with pytest.raises(CheckpointError, match="'model.layers.0.mlp.up_proj.weight'"):
        load_drafter("EAGLE", d, target)
    d = variant(good, os.path.join(root, "eagle_input_norm"),
                tensors=_set("model.layers.0.input_layernorm.weight", np.ones(64, np.float32)))
    with pytest.raises(CheckpointError, match="'model.layers.0.input_layernorm.weight'"):  # EAGLE has none
        load_drafter("EAGLE", d, target)
    d = variant(good, os.path.join(root, "eagle_two_layers"), config=lambda c: {**c, "num_hidden_layers": 2})
    with pytest.raises(ConfigError, match="num_hidden_layers"):
        load_drafter("EAGLE", d, target)
    with pytest.raises(ConfigError, match="EAGLE4"):
        load_drafter("EAGLE4", good, target)


def test_nextn_errors(targets, root, tiny_checkpoint):
    with pytest.raises(ConfigError, match="llama target has no MTP layer"):
        load_drafter("NEXTN", targets["llama"][0], targets["llama"][1])
    bare = tiny_checkpoint("qwen3_next", 7)
    with pytest.raises(CheckpointError, match=r"no `mtp\.\*` tensors"):
        load_drafter("NEXTN", bare, load_model(bare, dtype="float32"))
    # A missing MTP tensor is named as stored, `mtp.` prefix included.
    src, target = targets["qwen3_next"]
    d = os.path.join(root, "qwen3_next_mtp_missing")
    shutil.copytree(src, d)
    t = dict(load_file(os.path.join(d, td.MTP_SHARD)))
    save_file(_drop("mtp.layers.0.self_attn.v_proj.weight")(t), os.path.join(d, td.MTP_SHARD))
    with pytest.raises(CheckpointError, match=r"'mtp\.layers\.0\.self_attn\.v_proj\.weight'"):
        load_drafter("NEXTN", d, target)
    save_file(_drop("mtp.norm.weight")(t), os.path.join(d, td.MTP_SHARD))
    with pytest.raises(CheckpointError, match=r"'mtp\.norm\.weight'"):
        load_drafter("NEXTN", d, target)


# ----------------------------------------------------------------------------- config before weights


def _same_error(load, read):
    """load() and read() raise the same error type with the same message."""
    with pytest.raises(Exception) as a:
        load()
    with pytest.raises(Exception) as b:
        read()
    assert type(b.value) is type(a.value) and str(b.value) == str(a.value), (a.value, b.value)
    return b.value


@pytest.fixture(scope="module")
def dflash_dir(targets, root):
    d = os.path.join(root, "dflash_config")
    td.write_dflash(d, targets["qwen3"][0], seed=6, target_layer_ids=[0], num_layers=2, block_size=4)
    return d


def test_drafter_config_is_the_loaded_config(targets, root, eagle3_dir, dflash_dir):
    """drafter_config, from config.json alone, equals the config of the drafter load_drafter
    builds; its KV shape is the drafter's own (the heads' head_dim is not the qwen3 target's)."""
    eagle = os.path.join(root, "eagle_config")
    td.write_eagle(eagle, targets["qwen3"][0], seed=7, prefix="model.")
    cases = [("EAGLE", eagle, "qwen3"), ("EAGLE3", eagle3_dir, "llama"), ("NEXTN", targets["qwen3_next"][0],
             "qwen3_next"), ("NEXTN", targets["qwen3_5"][0], "qwen3_5"), ("DFLASH", dflash_dir, "qwen3")]
    for kind, d, name in cases:
        target = targets[name][1]
        cfg = drafter_config(kind, d, target.config)
        assert cfg == load_drafter(kind, d, target).config, kind
    assert drafter_config(None, eagle, targets["qwen3"][1].config) == drafter_config("EAGLE", eagle,
                                                                                     targets["qwen3"][1].config)
    head = drafter_config("eagle3", eagle3_dir, targets["llama"][1].config)
    assert head.attention_layer_ids == (0,) and head.num_key_value_heads == 2 and head.head_dim == 16
    assert targets["qwen3"][1].config.head_dim == 32
    assert drafter_config("EAGLE", eagle, targets["qwen3"][1].config).head_dim == 16
    dflash = drafter_config("DFLASH", dflash_dir, targets["qwen3"][1].config)
    assert dflash.attention_layer_ids == (0, 1) and dflash.head_dim == 16


def test_drafter_config_reads_no_tensors(targets, eagle3_dir, root):
    """A KV shape in config.json that the tensors contradict is still read (no tensor is); the
    loader reports the tensors."""
    d = variant(eagle3_dir, os.path.join(root, "eagle3_one_kv_head"),
                config=lambda c: {**c, "num_key_value_heads": 1})
    target = targets["llama"][1]
    assert drafter_config("EAGLE3", d, target.config).num_key_value_heads == 1
    with pytest.raises(CheckpointError, match="k_proj"):
        load_drafter("EAGLE3", d, target)


CONFIG_ERRORS = [e for e in ERRORS if "config" in e[1]]


@pytest.mark.parametrize("label, change, error, needle", CONFIG_ERRORS, ids=[e[0] for e in CONFIG_ERRORS])
def test_drafter_config_errors(targets, eagle3_dir, root, label, change, error, needle):
    """Every config.json problem the loader reports, drafter_config reports the same way."""
    d = variant(eagle3_dir, os.path.join(root, f"bad_{label}"), **change)
    target = targets["llama"][1]
    e = _same_error(lambda: load_drafter("EAGLE3", d, target), lambda: drafter_config("EAGLE3", d, target.config))
    assert isinstance(e, error) and needle in str(e)


def test_drafter_config_directory_errors(targets, root, dflash_dir, tiny_checkpoint):
    """Directory-level problems: the same error as load_drafter, for every kind."""
    llama, qwen3 = targets["llama"][1], targets["qwen3"][1]
    no_tensors = os.path.join(root, "config_only")
    os.makedirs(no_tensors, exist_ok=True)
    shutil.copy(os.path.join(dflash_dir, "config.json"), no_tensors)
    no_config = os.path.join(root, "tensors_only")
    os.makedirs(no_config, exist_ok=True)
    shutil.copy(os.path.join(dflash_dir, "model.safetensors"), no_config)
    bad_json = os.path.join(root, "bad_json")
    os.makedirs(bad_json, exist_ok=True)
    with open(os.path.join(bad_json, "config.json"), "w") as f:
        f.write("{")
    bare = tiny_checkpoint("qwen3_5", 8)
    cases = [
        ("EAGLE", os.path.join(root, "nowhere"), llama, ConfigError, "not a directory"),
        ("EAGLE5", dflash_dir, llama, ConfigError, "EAGLE5"),
        ("DFLASH", no_tensors, qwen3, CheckpointError, "holds neither"),
        ("DFLASH", no_config, qwen3, ConfigError, "no config.json"),
        ("EAGLE3", bad_json, llama, ConfigError, "not valid JSON"),
        ("EAGLE3", dflash_dir, qwen3, UnsupportedModelError, "EAGLE3"),
        ("DFLASH", dflash_dir, targets["qwen3_5"][1], ConfigError, "num_target_layers"),
        ("NEXTN", targets["llama"][0], llama, ConfigError, "no MTP layer"),
        ("NEXTN", no_tensors, targets["qwen3_5"][1], CheckpointError, "holds neither"),
    ]
    for kind, d, target, error, needle in cases:
        e = _same_error(lambda: load_drafter(kind, d, target), lambda: drafter_config(kind, d, target.config))
        assert isinstance(e, error) and needle in str(e), (kind, d, e)
    with pytest.raises(ConfigError, match="neither an EAGLE"):  # detection knows EAGLE heads only
        drafter_config(None, dflash_dir, qwen3.config)
    # The MTP tensors are the loader's to find: drafter_config reads the target's config.json only.
    assert drafter_config("NEXTN", bare, targets["qwen3_5"][1].config).attention_layer_ids == (0,)
    with pytest.raises(CheckpointError, match=r"no `mtp\.\*` tensors"):
        load_drafter("NEXTN", bare, targets["qwen3_5"][1])


def test_dflash_block_size(targets, root, dflash_dir):
    assert dflash_block_size(dflash_dir) == 4 == load_drafter("DFLASH", dflash_dir, targets["qwen3"][1]).block_size

    def variant(name, **change):
        d = os.path.join(root, f"dflash_block_{name}")
        shutil.copytree(dflash_dir, d)
        with open(os.path.join(d, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(d, "config.json"), "w") as f:
            json.dump({**cfg, **change}, f)
        return d

    nested = variant("nested", dflash_config={"block_size": 8, "mask_token_id": 3, "target_layer_ids": [0]})
    assert dflash_block_size(nested) == 8  # dflash_config's block_size wins over the top-level one
    # No readable config.json: None, and the loader reports it.
    assert dflash_block_size(os.path.join(root, "nowhere")) is None
    assert dflash_block_size(root) is None
    bad_json = os.path.join(root, "dflash_block_bad_json")
    os.makedirs(bad_json, exist_ok=True)
    with open(os.path.join(bad_json, "config.json"), "w") as f:
        f.write("not json")
    assert dflash_block_size(bad_json) is None
    # A readable config with a bad block size or another architecture: the loader's error.
    target = targets["qwen3"][1]
    for d in (variant("one", block_size=1), variant("float", block_size=4.0), variant("eagle", architectures=["X"])):
        _same_error(lambda: load_drafter("DFLASH", d, target), lambda: dflash_block_size(d))
    with pytest.raises(ConfigError, match="block_size=1 must be an int >= 2"):
        dflash_block_size(os.path.join(root, "dflash_block_one"))
