"""Write a byte-level tokenizer.json of exactly N tokens (the 256 byte tokens, then distinct
alphanumeric strings, then `<|endoftext|>`), for grammar benchmarks on random weights: the GPU
machine has no model hub, and a real but smaller tokenizer would leave most of a random model's
vocabulary (and its random drafter's proposals) outside every grammar.

    python3 bench/vocab_tokenizer.py 151936 /tmp/vocab_tokenizer
"""

from __future__ import annotations

import argparse
import itertools
import os
import string

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers


def build(num_tokens: int) -> Tokenizer:
    vocab = {c: i for i, c in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    symbols = string.ascii_letters + string.digits
    for length in itertools.count(2):
        for t in itertools.product(symbols, repeat=length):
            if len(vocab) >= num_tokens - 1:
                break
            vocab["".join(t)] = len(vocab)
        if len(vocab) >= num_tokens - 1:
            break
    vocab["<|endoftext|>"] = num_tokens - 1
    tok = Tokenizer(models.BPE(vocab, [], unk_token=None))  # no merges: text encodes byte by byte
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    return tok


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("num_tokens", type=int)
    p.add_argument("out_dir")
    args = p.parse_args()
    if args.num_tokens < 258:
        p.error("num_tokens must be at least 258 (256 bytes, one more token, <|endoftext|>)")
    os.makedirs(args.out_dir, exist_ok=True)
    build(args.num_tokens).save(os.path.join(args.out_dir, "tokenizer.json"))


if __name__ == "__main__":
    main()
