"""EAGLE3 and MTP drafter training: the dense unrolled forward against the engine's drafting path,
a few optimizer steps, and the exported checkpoints read back by the engine's loaders (and, for the
target carrying `mtp.*`, by transformers).

The engine path is run the way `jspec.speculative.eagle_step` runs a drafter: one extend over the window
(the catch-up: token p + 1 with the target's hidden at p), then, from every origin o, draft steps
as decodes at KV indices o + 1, o + 2, ... feeding back the drafter's own hidden, through a paged
cache whose pages are out of order and whose unowned slots hold NaN.
"""

from __future__ import annotations

import functools
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from checkpoints.safetensors_reader import SafetensorsCheckpoint
from jspec.cache.pool import allocate_caches
from jspec.models import load_model
from jspec.models.drafters import load_drafter
from jspec.speculative import verify
from jspec.train import data, eagle3, mtp
from jspec.train.cli import drafter_config
from jspec.train.dense import dense_forward
from jspec.train.history import save_history
from jspec.train.loop import TrainConfig, accept_estimate, make_opt, make_steps, train_loop
from jspec.train.ttt import ttt_attention, ttt_objective
from tests.support import models as tm
from tests.support.compiles import FAST
from tests.support.models import rel_err

B, T, STEPS = 2, 8, 3  # windows [B, T+1], unrolled draft steps
PAGE = 4
PAGES = [5, 2, 7, 0]  # the request's pages, out of order: room for T + STEPS - 1 KV entries
TOL = 1e-4


def windows(seed: int, n: int = B):
    return np.random.default_rng(seed).integers(0, tm.VOCAB, size=(n, T + 1)).astype(np.int32)


# ----------------------------------------------------------------------------- the engine's path
@functools.partial(jax.jit, static_argnums=(0, 2), compiler_options=FAST)
def _draft(dgd, dstate, tgd, tparams, batch, caches, hidden):
    drafter, target = nnx.merge(dgd, *dstate), nnx.merge(tgd, tparams)
    return drafter(batch, caches, hidden, target=target)


def engine_chains(drafter, target, window, hidden, num_steps: int):
    """(logits, hidden) `[num_steps, T, ...]` for one window `[T+1]`: step 0 from the catch-up
    extend over KV 0..T-1, step i at row o from draft step i of a chain started at o."""
    dgd, *dstate = nnx.split(drafter, nnx.Param, ...)
    tgd, tparams = nnx.split(target)
    dtype = jax.tree_util.tree_leaves(tparams)[0].dtype
    one = jnp.ones((1,), bool)
    table = jnp.asarray([PAGES], jnp.int32)
    slot = jnp.zeros((1,), jnp.int32)
    caches = allocate_caches(drafter.config, num_pages=8, page_size=PAGE, num_state_slots=1, dtype=dtype)
    caches = jax.tree_util.tree_map(lambda x: jnp.full_like(x, jnp.nan), caches)
    ext = verify.extend_batch(jnp.asarray(window[None, 1:]), jnp.zeros((1,), jnp.int32), one, table, slot, PAGE)
    out0, caught_up = _draft(dgd, tuple(dstate), tgd, tparams, ext, caches, hidden)
    logits = np.zeros((num_steps, T, out0.logits.shape[-1]), np.float32)
    hid = np.zeros((num_steps, T, out0.hidden.shape[-1]), np.float32)
    logits[0], hid[0] = out0.logits, out0.hidden
    tokens = np.concatenate([window, np.zeros(num_steps, np.int32)])
    for o in range(T):
        c, h = caught_up, out0.hidden[o:o + 1]
        for i in range(1, num_steps):
            pos = jnp.asarray([o + i], jnp.int32)
            dec = verify.decode_batch(jnp.asarray(tokens[o + i + 1:o + i + 2]), pos, one, table, slot, PAGE)
            out, c = _draft(dgd, tuple(dstate), tgd, tparams, dec, c, h)
            logits[i, o], hid[i, o], h = out.logits[0], out.hidden[0], out.hidden
    return logits, hid


# ----------------------------------------------------------------------------- fixtures
@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return str(tmp_path_factory.mktemp("drafter_training"))


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return load_model(tiny_checkpoint("qwen3", 1), dtype="float32")


@pytest.fixture(scope="module")
def qwen3_next(tiny_checkpoint):
    """A sharded Qwen3-Next target with an index and no MTP layer yet; (dir, model, HF logits)."""
    d, hf = tiny_checkpoint("qwen3_next", 2, "100KB"), tiny_checkpoint.hf("qwen3_next", 2, "100KB")
    assert os.path.exists(os.path.join(d, mtp.INDEX))
    return d, load_model(d, dtype="float32"), tm.hf_logits(hf, windows(9, 1)[0])


@pytest.fixture(scope="module")
def corpus(root):
    """Token files: a skewed train corpus (so frequency picks a definite draft vocabulary) and a
    held-out one."""
    rng = np.random.default_rng(0)
    train = (rng.zipf(1.3, size=4000) % tm.VOCAB).astype(np.uint16)
    held = rng.integers(0, tm.VOCAB, size=600).astype(np.uint16)
    paths = os.path.join(root, "train.npy"), os.path.join(root, "heldout.npy")
    np.save(paths[0], train)
    np.save(paths[1], held)
    return paths


def small_cfg(**kw):
    """Runs of 10 steps unrolled over 2 draft steps (3 in the parity tests; 2 compile faster)."""
    return TrainConfig(**{**dict(steps=10, batch_size=B, seq_len=T, ttt_steps=2, lr=1e-2, warmup_steps=2,
                                 log_every=1, eval_every=10, eval_windows=4, eval_batch_size=2), **kw})


@functools.partial(jax.jit, static_argnums=(0, 1, 2), compiler_options=FAST)
def dense_outputs(kind, tgd, dgd, tparams, dstate, window):
    """(target features the drafter reads, its unrolled outputs) over windows `[B, T+1]`, jitted
    (eagerly each op would compile on its own)."""
    target, drafter = nnx.merge(tgd, tparams), nnx.merge(dgd, *dstate)
    _, final, aux = dense_forward(target, window[:, :-1], capture_layers=drafter.capture_layers)
    if kind == "eagle3":
        features = aux.reshape(*aux.shape[:2], -1)
        return features, eagle3.eagle3_unrolled(drafter, target, window, features, STEPS)
    return final, mtp.mtp_unrolled(drafter, target, window, final, STEPS)


def check_against_engine(kind, target, drafter, window, rows=range(B), tol=TOL):
    """The dense unrolled outputs equal the engine's drafting path, every step, every origin."""
    tgd, tparams = nnx.split(target)
    dgd, *dstate = nnx.split(drafter, nnx.Param, ...)
    hidden, outs = dense_outputs(kind, tgd, dgd, tparams, tuple(dstate), jnp.asarray(window))
    for b in rows:
        logits, hid = engine_chains(drafter, target, window[b], hidden[b], STEPS)
        for i in range(STEPS):
            assert rel_err(outs[i][0][b], logits[i]) < tol, (b, i)
            assert rel_err(outs[i][1][b], hid[i]) < tol, (b, i)
    return outs


def perturbed(module, seed):
    """The module with every vector (norm weights) moved off its init, which would hide a mix-up of
    norms; returns (graphdef, params, rest)."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    rng = np.random.default_rng(seed)  # on the host: eager jax ops would each compile

    def move(p):
        return jnp.asarray(np.asarray(p) + 0.1 * rng.standard_normal(p.shape, np.float32)) if p.ndim == 1 else p

    return graphdef, jax.tree_util.tree_map(move, params), rest


def fixed_corpus(root, name, seed):
    """A token file one window long: every sampled batch is the same window, B times."""
    path = os.path.join(root, name)
    np.save(path, windows(seed, 1)[0].astype(np.uint16))
    return path


def train_losses(out_dir, name):
    with open(os.path.join(out_dir, f"{name}_history.json")) as f:
        hist = json.load(f)
    return [r["loss"] for r in hist["history"] if r["split"] == "train"], hist


# ----------------------------------------------------------------------------- EAGLE3
HEAD = dict(intermediate_size=80, num_attention_heads=4, num_key_value_heads=2, head_dim=16)


def test_draft_vocab_and_capture_layers(corpus):
    tokens = np.load(corpus[0])
    hot = eagle3.draft_vocab_ids(tokens, 50, tm.VOCAB)
    counts = np.bincount(tokens, minlength=tm.VOCAB)
    assert len(hot) == 50 and np.all(np.diff(hot) > 0)
    assert counts[hot].min() >= np.delete(counts, hot).max()
    # A 2-layer target: SGLang's (2, 1, -1) clipped to the entering streams 0, 1, 2, written as -1, 0, 1.
    assert eagle3.default_aux_layer_ids(2) == [-1, 0, 1] and eagle3.default_aux_layer_ids(24) == [1, 11, 20]


def test_eagle3_dense_matches_engine(qwen3, corpus):
    hot = eagle3.draft_vocab_ids(np.load(corpus[0]), 50, tm.VOCAB)
    drafter = nnx.merge(*perturbed(eagle3.init_eagle3(qwen3, hot, seed=3, **HEAD), 0))
    assert drafter.capture_layers == (0, 1, 2) and drafter.draft_vocab_size == 50
    check_against_engine("eagle3", qwen3.module(), drafter, windows(1))


def test_eagle3_train_and_export(qwen3, root):
    """A run on a one-window corpus (a fixed batch): the loss falls, and the exported head, read
    back by `load_drafter`, drafts what the trained parameters do."""
    out = os.path.join(root, "eagle3_run")
    summary = eagle3.train_eagle3(qwen3.path, fixed_corpus(root, "eagle3_fixed.npy", 2), None, out, small_cfg(),
                                  draft_vocab=50, compiler_options=FAST, log=lambda m: None, **HEAD)
    losses, hist = train_losses(out, "eagle3")
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses
    assert os.path.exists(os.path.join(out, "eagle3_history.png")) and hist["meta"]["safetensors_mib"] < 15

    raw = summary["config_json"]
    assert raw["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [-1, 0, 1]
    assert raw["architectures"] == ["LlamaForCausalLMEagle3"] and raw["draft_vocab_size"] == 50
    ck = SafetensorsCheckpoint(out)
    assert "embed_tokens.weight" not in ck.names() and {"d2t", "t2d", "lm_head.weight"} <= set(ck.names())
    assert str(ck.dtype("fc.weight")) == "bfloat16" and ck.dtype("d2t") == np.int64
    hot = np.nonzero(np.asarray(ck.get("t2d")))[0]

    trained = summary["drafter"]
    out32 = os.path.join(root, "eagle3_f32")
    eagle3.export_eagle3(trained, out32, dtype="float32")
    target = qwen3.module()
    tgd, tparams = nnx.split(target)
    dgd, *dstate = nnx.split(trained, nnx.Param, ...)
    features, ours = dense_outputs("eagle3", tgd, dgd, tparams, tuple(dstate), jnp.asarray(windows(5)))
    for path, tol in ((out32, TOL), (out, 3e-2)):  # bf16: the same parameters to bf16 precision
        dm = load_drafter("EAGLE3", path, qwen3, dtype="float32")
        assert dm.capture_layers == (0, 1, 2)
        loaded = dm.module()
        np.testing.assert_array_equal(np.asarray(loaded.to_target_ids(jnp.arange(50, dtype=jnp.int32))), hot)
        logits, _ = engine_chains(loaded, target, windows(5)[0], features[0], STEPS)
        for i in range(STEPS):
            assert rel_err(logits[i], ours[i][0][0]) < tol, (path, i)


# ----------------------------------------------------------------------------- MTP
def test_mtp_dense_matches_engine(qwen3_next):
    _, target, _ = qwen3_next
    drafter = nnx.merge(*perturbed(mtp.init_mtp(target, seed=4), 1))
    assert drafter.config.moe_layers == (True,)
    check_against_engine("mtp", target.module(), drafter, windows(3))


def test_mtp_train_and_export(qwen3_next, root):
    """A run on a fixed batch lowers the loss; the layer written into a copy of the sharded target
    loads in jspec (NEXTN) and drafts what the trained parameters do, and transformers still loads
    the target with unchanged logits. Exporting again replaces the layer; a single-file target
    gets it inside model.safetensors."""
    import transformers
    from safetensors.numpy import save_file

    tdir, target, hf_before = qwen3_next
    out = os.path.join(root, "qwen3_next_run")
    summary = mtp.train_mtp(tdir, fixed_corpus(root, "mtp_fixed.npy", 4), None, out, small_cfg(), compiler_options=FAST,
                            log=lambda m: None)
    losses, _ = train_losses(out, "mtp")
    assert len(losses) == 10 and losses[-1] < 0.5 * losses[0], losses
    trained = summary["drafter"]
    assert not any(n.startswith("mtp.") for n in SafetensorsCheckpoint(tdir).names())  # the source is untouched

    written = mtp.export_mtp(trained, out, dtype=np.float32)  # again, in place, float32: replaces
    assert "mtp.layers.0.mlp.experts.0.gate_proj.weight" in written and "mtp.fc.weight" in written
    with open(os.path.join(out, mtp.INDEX)) as f:
        wm = json.load(f)["weight_map"]
    assert {n for n in wm if n.startswith("mtp.")} == set(written) and {wm[n] for n in written} == {mtp.SHARD}
    with open(os.path.join(out, "config.json")) as f:
        assert json.load(f)["mtp_num_hidden_layers"] == 1

    loaded_target = load_model(out, dtype="float32")
    dm = load_drafter("NEXTN", out, loaded_target)
    tgd, tparams = nnx.split(target.module())
    dgd, *dstate = nnx.split(trained, nnx.Param, ...)
    window = windows(6)
    final, ours = dense_outputs("mtp", tgd, dgd, tparams, tuple(dstate), jnp.asarray(window))
    # The target with mtp_num_hidden_layers set is the same network: the original stands in for
    # it (one compiled engine step for both tests).
    logits, _ = engine_chains(dm.module(), target.module(), window[0], final[0], STEPS)
    for i in range(STEPS):
        assert rel_err(logits[i], ours[i][0][0]) < TOL, i

    hf = transformers.Qwen3NextForCausalLM.from_pretrained(out).eval()
    np.testing.assert_allclose(tm.hf_logits(hf, windows(9, 1)[0]), hf_before, rtol=1e-5, atol=1e-5)

    single = os.path.join(root, "qwen3_next_single")
    os.makedirs(single)
    src = SafetensorsCheckpoint(tdir)
    save_file({n: np.array(src.get(n)) for n in src.names()}, os.path.join(single, "model.safetensors"),
              metadata={"format": "pt"})
    with open(os.path.join(tdir, "config.json")) as f, open(os.path.join(single, "config.json"), "w") as g:
        g.write(f.read())
    mtp.export_mtp(trained, single, dtype=np.float32)
    assert sorted(os.listdir(single)) == ["config.json", "model.safetensors"]
    dm1 = load_drafter("NEXTN", single, load_model(single, dtype="float32"))
    for (path, a), (_, b) in zip(dm.params.flat_state(), dm1.params.flat_state()):
        np.testing.assert_array_equal(np.asarray(a.get_value()), np.asarray(b.get_value()), err_msg=str(path))


# ----------------------------------------------------------------------------- pieces
def test_unrolled_attention_mask():
    """Step i at row o sees step 0's keys at rows <= o and steps 1..i's keys at row o only: with
    values that one-hot their source (step, row), the output is a mix of exactly those."""
    t, steps = 5, 3
    q = jnp.zeros((1, t, 1, steps * t))  # uniform attention over what is allowed
    ks = [jnp.zeros((1, t, 1, steps * t)) for _ in range(steps)]
    vs = [jax.nn.one_hot(jnp.arange(t) + s * t, steps * t)[None, :, None, :] for s in range(steps)]
    for i in range(steps):
        out = np.asarray(jax.jit(ttt_attention, static_argnames="scale")(q, ks[:i + 1], vs[:i + 1], scale=1.0))
        out = out[0, :, 0]
        for o in range(t):
            seen = [r for r in range(o + 1)] + [s * t + o for s in range(1, i + 1)]
            want = np.zeros(steps * t)
            want[seen] = 1.0 / len(seen)
            np.testing.assert_allclose(out[o], want, atol=1e-6)


def test_objective_masks_and_accuracy():
    """Rows past the window are not scored; a target argmax outside the draft vocabulary counts
    against accuracy but not in the loss."""
    v, hot = 6, jnp.asarray([1, 3, 4])
    tl = jnp.zeros((1, 4, v)).at[0, 1, 3].set(5.0).at[0, 2, 5].set(5.0).at[0, 3, 1].set(5.0)
    dl = jnp.zeros((1, 4, 3)).at[0, 0, 1].set(5.0).at[0, 1, 0].set(5.0).at[0, 2, 2].set(5.0)  # ids 3, 1, 4
    loss, m = jax.jit(ttt_objective)([dl], tl, hot_ids=hot)
    # Step 0 scores rows 0..2 against target rows 1..3 (argmax 3, 5, 1): row 0 is right; row 1
    # can never be (5 is not drafted) and stays out of the loss; row 2 is wrong.
    assert abs(float(m["acc_0"]) - 1 / 3) < 1e-6
    tl, dl = np.asarray(tl, np.float64), np.asarray(dl, np.float64)
    sub = tl[0, [1, 3]][:, np.asarray(hot)]
    logp = sub - np.log(np.exp(sub).sum(-1, keepdims=True))
    logq = dl[0, [0, 2]] - np.log(np.exp(dl[0, [0, 2]]).sum(-1, keepdims=True))
    assert abs(float(loss) - np.mean(np.sum(np.exp(logp) * (logp - logq), axis=-1))) < 1e-5
    assert accept_estimate([0.5, 0.5]) == 1.75


def test_train_loop_logs_heldout(corpus, root):
    """The loop (on a toy loss): train rows every log_every steps, held-out rows every eval_every
    steps and at the end, over the same fixed windows."""
    def loss_fn(params, frozen, window):
        err = params["w"] - jnp.mean(window.astype(jnp.float32)) / frozen
        loss = jnp.sum(err ** 2)
        return loss, {"loss_0": loss, "acc_0": jnp.exp(-loss), "loss_1": loss, "acc_1": jnp.exp(-2 * loss)}

    cfg = small_cfg(steps=5, log_every=2, eval_every=3, lr=0.1)
    opt = make_opt(cfg)
    train_step, eval_step = make_steps(loss_fn, opt, FAST)
    params = {"w": jnp.zeros((3,))}
    held = data.eval_windows(data.load_tokens(corpus[1]), T, cfg.eval_windows)
    lines = []
    _, history, timing = train_loop(train_step, eval_step, params, opt.init(params), jnp.float32(100.0),
                                    data.sample_batches(np.load(corpus[0]), B, T), cfg, heldout=held,
                                    log=lines.append)
    assert [(r["step"], r["split"]) for r in history] == [(2, "train"), (3, "heldout"), (4, "train"), (5, "train"),
                                                          (5, "heldout")]
    assert timing["steps"] == 5 and timing["compile_s"] > 0
    first, last = history[1], history[-1]
    assert last["loss"] < first["loss"] and abs(last["accept_estimate"] - accept_estimate(
        [last["acc_0"], last["acc_1"]])) < 1e-9
    assert len(lines) == 6 and "heldout" in lines[2]  # the first line times the compile


def test_history_files(root):
    rows = [{"step": s, "split": "train", "loss": 1.0 / s, "acc_0": 0.1 * s} for s in (1, 2)]
    rows.append({"step": 2, "split": "heldout", "loss": 0.6, "acc_0": 0.3})
    paths = save_history(rows, os.path.join(root, "hist"), "x", meta={"a": 1})
    with open(paths["json"]) as f:
        assert json.load(f) == {"meta": {"a": 1}, "history": rows}
    assert os.path.getsize(paths["png"]) > 0


def test_cli_flags():
    """`jspec train eagle3 | mtp` parse into the run's TrainConfig."""
    from jspec.cli import build_parser

    args = build_parser().parse_args(["train", "eagle3", "--target", "t", "--corpus", "c.npy", "--out", "o",
                                      "--ttt-steps", "4", "--time-budget", "90", "--draft-vocab", "1024"])
    cfg = drafter_config(args)
    assert (cfg.ttt_steps, cfg.time_budget_s, args.draft_vocab) == (4, 90.0, 1024)
    args = build_parser().parse_args(["train", "mtp", "--target", "t", "--corpus", "c.npy", "--in-place"])
    assert args.in_place and drafter_config(args).steps == TrainConfig().steps
