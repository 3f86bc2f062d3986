"""Loading real HF layouts: sharded, fused / transposed MoE experts, the Qwen3.5 hub wrapper; orbax
conversion bitwise; every checkpoint error names its tensor; CLI convert / inspect."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from jspec.cli import main as cli_main
from jspec.errors import CheckpointError, InvalidRequestError
from jspec.models import load_model
from tests.support import models as tm
from tests.support.models import rel_err

TOL = 1e-4


@pytest.fixture(scope="module")
def qwen3(tiny_checkpoint):
    return tiny_checkpoint("qwen3", 5), tiny_checkpoint.hf("qwen3", 5)


@pytest.fixture(scope="module")
def moe(tiny_checkpoint):
    return tiny_checkpoint("qwen3_moe", 6), tiny_checkpoint.hf("qwen3_moe", 6)


def test_sharded_checkpoint(tiny_checkpoint):
    d, hf = tiny_checkpoint("qwen3_next", 2, "60KB"), tiny_checkpoint.hf("qwen3_next", 2, "60KB")
    assert "model.safetensors.index.json" in os.listdir(d)
    assert sum(f.endswith(".safetensors") for f in os.listdir(d)) > 2
    ids = tm.random_ids(17, seed=4)
    assert rel_err(load_model(d).score(ids), tm.hf_logits(hf, ids)) < TOL


@pytest.mark.parametrize("transpose", [False, True])
def test_fused_expert_layouts(moe, tmp_path, transpose):
    """Per-expert tensors (what transformers writes) stacked into experts.gate_up_proj [X, 2I, E]
    (or its transpose): same logits."""
    src, hf = moe

    def fuse(t):
        out = {k: v for k, v in t.items() if ".mlp.experts." not in k}
        layers = sorted({k.split(".mlp.experts.")[0] for k in t if ".mlp.experts." in k})
        for layer in layers:
            n = len({k.split(".")[5] for k in t if k.startswith(layer + ".mlp.experts.")})
            gu = np.stack([np.concatenate([t[f"{layer}.mlp.experts.{j}.gate_proj.weight"],
                                           t[f"{layer}.mlp.experts.{j}.up_proj.weight"]]) for j in range(n)])
            dn = np.stack([t[f"{layer}.mlp.experts.{j}.down_proj.weight"] for j in range(n)])
            if transpose:
                gu, dn = np.swapaxes(gu, 1, 2).copy(), np.swapaxes(dn, 1, 2).copy()
            out[f"{layer}.mlp.experts.gate_up_proj"] = gu
            out[f"{layer}.mlp.experts.down_proj"] = dn
        return out

    d = tm.variant(src, str(tmp_path / f"fused{transpose}"), tensors=fuse)
    ids = tm.random_ids(15, seed=8)
    assert rel_err(load_model(d).score(ids), tm.hf_logits(hf, ids)) < TOL


def test_qwen3_5_hub_layout(tiny_checkpoint, tmp_path):
    """Qwen3_5ForConditionalGeneration: text_config nesting, `model.language_model.` prefix, vision
    weights ignored, `mtp.*` kept aside for the MTP drafter."""
    src, hf = tiny_checkpoint("qwen3_5", 9), tiny_checkpoint.hf("qwen3_5", 9)
    with open(os.path.join(src, "config.json")) as f:
        text_cfg = json.load(f)
    wrapper = {"architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5",
               "text_config": {k: v for k, v in text_cfg.items() if k != "architectures"},
               "vision_config": {"depth": 1}, "tie_word_embeddings": text_cfg["tie_word_embeddings"]}

    def rename(t):
        out = {("model.language_model." + k[len("model."):] if k.startswith("model.") else k): v
               for k, v in t.items()}
        out["model.visual.blocks.0.attn.qkv.weight"] = np.ones((3, 3), np.float32)
        out["mtp.fc.weight"] = np.ones((4, 8), np.float32)
        return out

    d = tm.variant(src, str(tmp_path / "hub"), tensors=rename)
    with open(os.path.join(d, "config.json"), "w") as f:
        json.dump(wrapper, f)
    m = load_model(d)
    assert m.config.weight_prefix == "model.language_model."
    assert "mtp.fc.weight" in m.extras
    ids = tm.random_ids(12, seed=3)
    assert rel_err(m.score(ids), tm.hf_logits(hf, ids)) < TOL


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_orbax_round_trip_is_bitwise(qwen3, tmp_path, dtype):
    src, _ = qwen3
    out = str(tmp_path / f"orbax-{dtype}")
    assert cli_main(["convert", "--hf", src, "--out", out, "--dtype", dtype, "--quiet"]) == 0
    a, b = load_model(src, dtype=dtype), load_model(out, dtype=dtype)
    la, lb = jax.tree_util.tree_leaves(a.params), jax.tree_util.tree_leaves(b.params)
    assert len(la) == len(lb) > 0
    for x, y in zip(la, lb):
        assert x.dtype == y.dtype and x.shape == y.shape
        assert np.array_equal(np.asarray(x).view(np.uint8), np.asarray(y).view(np.uint8))
    assert a.config == b.config


def test_inspect(qwen3, capsys):
    src, _ = qwen3
    assert cli_main(["inspect", src, "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    m = load_model(src)
    assert info["num_parameters"] == m.num_parameters()
    assert info["layer_pattern"] == "AA" and info["architecture"] == "Qwen3ForCausalLM"


# ------------------------------------------------------------------------------------ errors

VICTIM = "model.layers.1.self_attn.k_proj.weight"


def _expect_error(path, tensor):
    with pytest.raises(CheckpointError) as e:
        load_model(path)
    assert tensor in str(e.value), str(e.value)
    return e.value


def test_missing_tensor(qwen3, tmp_path):
    d = tm.variant(qwen3[0], str(tmp_path / "m"), tensors=lambda t: {k: v for k, v in t.items() if k != VICTIM})
    _expect_error(d, VICTIM)


def test_unexpected_tensor(qwen3, tmp_path):
    name = "model.layers.0.self_attn.extra_proj.weight"
    d = tm.variant(qwen3[0], str(tmp_path / "u"), tensors=lambda t: {**t, name: np.zeros((2, 2), np.float32)})
    _expect_error(d, name)


def test_wrong_shape(qwen3, tmp_path):
    d = tm.variant(qwen3[0], str(tmp_path / "s"), tensors=lambda t: {**t, VICTIM: t[VICTIM][:-1]})
    err = _expect_error(d, VICTIM)
    assert "shape" in str(err)


def test_truncated_file(qwen3, tmp_path):
    d = str(tmp_path / "t")
    shutil.copytree(qwen3[0], d)
    f = os.path.join(d, "model.safetensors")
    size = os.path.getsize(f)
    with open(f, "r+b") as fh:
        fh.truncate(size - 64)  # the last tensor in the file loses its tail
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "tensor" in str(e.value) and "model.safetensors" in str(e.value)


def test_unreadable_file(qwen3, tmp_path):
    d = str(tmp_path / "g")
    shutil.copytree(qwen3[0], d)
    with open(os.path.join(d, "model.safetensors"), "wb") as fh:
        fh.write(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    with pytest.raises(CheckpointError) as e:
        load_model(d)
    assert "model.safetensors" in str(e.value)


def test_cli_reports_errors(tmp_path, capsys):
    assert cli_main(["convert", "--hf", str(tmp_path), "--out", str(tmp_path / "o"), "--quiet"]) == 2
    assert "safetensors" in capsys.readouterr().err


def test_score_rejects_bad_ids(qwen3):
    m = load_model(qwen3[0])
    with pytest.raises(InvalidRequestError, match="vocabulary"):
        m.score([1, 2, tm.VOCAB])
    with pytest.raises(InvalidRequestError, match="empty"):
        m.score([])


def test_tokenizer_loads_when_present(qwen3, tmp_path):
    d = str(tmp_path / "tok")
    shutil.copytree(qwen3[0], d)
    tok = tm.word_tokenizer({"hello": 0, "world": 1, "[UNK]": 2}, unk="[UNK]")
    tok.save(os.path.join(d, "tokenizer.json"))
    m = load_model(d)
    assert m.tokenizer.encode("hello world").ids == [0, 1]
    assert load_model(qwen3[0]).tokenizer is None


@pytest.mark.parametrize("preset", ["tiny-qwen3-moe", "tiny-qwen3-next"])
def test_make_random_writes_real_hf_format(tmp_path, preset):
    """`jspec make-random` output loads in transformers with the same logits as in jspec."""
    import transformers

    from jspec.models.presets import write_random_checkpoint

    d = write_random_checkpoint(str(tmp_path / preset), preset, seed=3)
    hf = transformers.AutoModelForCausalLM.from_pretrained(d, dtype=torch_float32()).eval()
    ids = [5, 17, 3, 99, 42, 7, 250, 1]
    assert rel_err(load_model(d).score(ids), tm.hf_logits(hf, ids)) < TOL


def torch_float32():
    import torch

    return torch.float32
