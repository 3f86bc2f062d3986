"""Byte-level BPE tokenizer for the shipped model family, trained on the train split only.

Special tokens take the first ids: `<|endoftext|>` 0, `<|user|>` 1, `<|assistant|>` 2, `<|mask|>` 3
(DFlash's mask token). The directory holds `tokenizer.json` (read by jspec's loader and by
`tokenizers`) and `tokenizer_config.json` (so `transformers.AutoTokenizer` builds a
`PreTrainedTokenizerFast` with the same special tokens and a chat template of our rendering).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from jspec.errors import ConfigError
from jspec.models.loader import load_tokenizer as read_tokenizer_json
from jspec.train.data import ASSISTANT, ENDOFTEXT, MASK, SPECIAL_TOKENS, USER

DEFAULT_VOCAB_SIZE = 8192
MODEL_MAX_LENGTH = 2048

# transformers' chat template for `data.render_conversation` (system turns dropped, as there).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}" + USER + "{{ message['content'] }}"
    "{% elif message['role'] == 'assistant' %}" + ASSISTANT + "{{ message['content'] }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}" + ASSISTANT + "{% endif %}"
)


def train_tokenizer(texts: Iterable[str], vocab_size: int = DEFAULT_VOCAB_SIZE, *, length: int | None = None,
                    show_progress: bool = False):
    """A byte-level BPE `tokenizers.Tokenizer` learnt from `texts` (message texts, no role tokens).

    Byte level: any UTF-8 text encodes without an unknown token, and decoding inverts encoding."""
    if vocab_size < 256 + len(SPECIAL_TOKENS) or vocab_size > 1 << 16:
        raise ConfigError(f"vocab_size={vocab_size}: must hold the 256 bytes and the special tokens, "
                          "and fit uint16 ids")
    tok = Tokenizer(models.BPE())
    # GPT-2's split (words, numbers, punctuation, whitespace runs) without a prefix space: the text
    # right after a role token starts a word of its own either way.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),  # first, so they get ids 0..3
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        max_token_length=24,  # long runs of '-' or '=' in code would otherwise take whole tokens
        show_progress=show_progress,
    )
    tok.train_from_iterator(texts, trainer, length=length)
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise AssertionError(f"special token {s} got id {tok.token_to_id(s)}, expected {i}")
    return tok


def tokenizer_config() -> dict:
    """`tokenizer_config.json` for transformers' `PreTrainedTokenizerFast`."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": MODEL_MAX_LENGTH,
        "bos_token": None,
        "eos_token": ENDOFTEXT,
        "pad_token": ENDOFTEXT,
        "unk_token": None,
        "mask_token": MASK,
        "additional_special_tokens": [USER, ASSISTANT],
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
    }


def save_tokenizer(tok, out_dir: str) -> None:
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(), f, indent=2)


def load_tokenizer(path: str):
    """The `tokenizers.Tokenizer` of a directory written by `save_tokenizer` (or a model directory)."""
    tok = read_tokenizer_json(path)
    if tok is None:
        raise ConfigError(f"{path!r} has no tokenizer.json (write one with `jspec train tokenizer`)")
    return tok


def special_token_ids(tok) -> dict[str, int]:
    return {s: tok.token_to_id(s) for s in SPECIAL_TOKENS}


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")
