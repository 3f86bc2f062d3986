"""Tiny random Hugging Face checkpoints for parity tests (built with transformers, saved to disk),
and what the tests do with them: copies with changed config / tensors, a word-level tokenizer, the
relative error the parity checks bound.

Every parameter is perturbed away from its initial value so that norm conventions (w vs 1 + w),
biases and gates all matter to the logits. Tests that only read a checkpoint get it from the
session's `tiny_checkpoint` fixture (tests/conftest.py), built once per name and seed.
"""

from __future__ import annotations

import json
import os
import shutil

import numpy as np

VOCAB = 97

# name -> (transformers config class name, model class name, config kwargs)
SPECS = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, tie_word_embeddings=False),
    ),
    "llama_bias_llama3": (
        "LlamaConfig",
        "LlamaForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=4, attention_bias=True, mlp_bias=True, tie_word_embeddings=True,
             max_position_embeddings=256,
             rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0, low_freq_factor=1.0,
                                  high_freq_factor=4.0, original_max_position_embeddings=16)),
    ),
    "qwen3": (
        "Qwen3Config",
        "Qwen3ForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, tie_word_embeddings=True),
    ),
    "qwen3_moe": (
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_experts=8,
             num_experts_per_tok=2, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[1],
             tie_word_embeddings=False),
    ),
    "qwen3_next": (
        "Qwen3NextConfig",
        "Qwen3NextForCausalLM",
        dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             num_experts=4, num_experts_per_tok=2, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             full_attention_interval=3, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0],
             partial_rotary_factor=0.25, tie_word_embeddings=False),
    ),
    "qwen3_5": (
        "Qwen3_5TextConfig",
        "Qwen3_5ForCausalLM",
        dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4,
             linear_key_head_dim=16, linear_value_head_dim=16, linear_conv_kernel_dim=4,
             tie_word_embeddings=True),
    ),
    "qwen3_5_moe": (
        "Qwen3_5MoeTextConfig",
        "Qwen3_5MoeForCausalLM",
        dict(hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=4,
             num_experts_per_tok=2, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=32, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=16,
             linear_value_head_dim=16, linear_conv_kernel_dim=4, tie_word_embeddings=False),
    ),
}


def perturb_(model, seed: int = 0) -> None:
    """Add noise to every parameter so no weight keeps its init (ones, zeros, identity)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=gen, dtype=torch.float32)
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.rand(p.shape, generator=gen) * 4 + 0.5))
            elif p.ndim == 1:
                p.add_(0.1 * noise)
            else:
                p.copy_(0.08 * noise)


def build(name: str, out_dir: str, *, seed: int = 0, max_shard_size=None):
    """Create, perturb and `save_pretrained` a tiny model. Returns the torch model (eval, fp32)."""
    import torch
    import transformers

    cfg_cls, model_cls, kwargs = SPECS[name]
    cfg = getattr(transformers, cfg_cls)(vocab_size=VOCAB, **kwargs)
    torch.manual_seed(seed)
    model = getattr(transformers, model_cls)(cfg).eval().to(torch.float32)
    perturb_(model, seed)
    save_kw = {} if max_shard_size is None else {"max_shard_size": max_shard_size}
    model.save_pretrained(out_dir, **save_kw)
    return model


def hf_logits(model, ids) -> np.ndarray:
    import torch

    with torch.no_grad():
        out = model(torch.tensor([list(ids)], dtype=torch.long))
    return out.logits[0].float().numpy()


def random_ids(n: int, seed: int = 0) -> list[int]:
    return np.random.default_rng(seed).integers(0, VOCAB, size=n).tolist()


def list_files(d: str) -> list[str]:
    return sorted(os.listdir(d))


def rel_err(got, ref) -> float:
    """max |got - ref| / max |ref|, in float64."""
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.max(np.abs(got - ref)) / np.max(np.abs(ref)))


def variant(src: str, dst: str, *, config=None, tensors=None) -> str:
    """A copy of a single-file checkpoint directory with config.json passed through config(dict)
    and the tensors of model.safetensors through tensors(dict); every other file copied as is."""
    from safetensors.numpy import load_file, save_file

    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f != "model.safetensors" and not (config is not None and f == "config.json"):
            shutil.copyfile(os.path.join(src, f), os.path.join(dst, f))
    if config is not None:
        with open(os.path.join(src, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(dst, "config.json"), "w") as f:
            json.dump(config(cfg), f)
    t = dict(load_file(os.path.join(src, "model.safetensors")))
    save_file(tensors(t) if tensors is not None else t, os.path.join(dst, "model.safetensors"))
    return dst


def word_tokenizer(vocab: dict, unk: str):
    """A whitespace-split word-level `tokenizers.Tokenizer` over vocab (word -> id)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel(vocab, unk_token=unk))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


class TinyCheckpoints:
    """`build` once per (name, seed, max_shard_size) under a session's temporary folder: the
    session fixture `tiny_checkpoint` (tests/conftest.py). Calling it gives the directory, `hf`
    the transformers model saved there. Readers only: a test that changes a checkpoint builds its
    own (or copies one with `variant`)."""

    def __init__(self, tmp_path_factory):
        self._tmp = tmp_path_factory
        self._built: dict = {}

    def _get(self, name: str, seed: int, max_shard_size=None):
        key = (name, seed, max_shard_size)
        if key not in self._built:
            d = str(self._tmp.mktemp(f"tiny_{name}_{seed}"))
            self._built[key] = d, build(name, d, seed=seed, max_shard_size=max_shard_size)
        return self._built[key]

    def __call__(self, name: str, seed: int, max_shard_size=None) -> str:
        return self._get(name, seed, max_shard_size)[0]

    def hf(self, name: str, seed: int, max_shard_size=None):
        return self._get(name, seed, max_shard_size)[1]


def char_tokenizer():
    """A byte-level `tokenizers.Tokenizer` of VOCAB tokens: `<eos>` (0), the 95 printable ASCII
    characters (1..95, one token each) and `<unk>` (96). Byte-level, as real checkpoints' tokenizers
    are, so that llguidance can read it: structured-output tests (regex, JSON) on tiny models."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

    # GPT-2's byte -> character map: printable ASCII stands for itself; the space is the 33rd byte
    # outside the printable ranges, so it becomes chr(256 + 32) ("Ġ").
    byte_char = {b: chr(b) for b in range(33, 127)}
    byte_char[32] = chr(256 + 32)
    assert set(byte_char.values()) <= set(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<eos>": 0, **{byte_char[b]: i + 1 for i, b in enumerate(range(32, 127))}, "<unk>": VOCAB - 1}
    tok = Tokenizer(models.BPE(vocab, [], unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<eos>", special=True)])
    return tok
