"""bench/input_logprob_ttft.py on the tiny Qwen3 shape: one engine per block budget, each prompt
kind timed, the block size each budget gives recorded (a broken script fails here, not on a GPU)."""

from __future__ import annotations

import json

from bench import input_logprob_ttft
from jspec.runtime import step


def test_each_budget_times_every_kind(tmp_path, monkeypatch):
    monkeypatch.setattr(step, "INPUT_LOGPROB_BYTES", step.INPUT_LOGPROB_BYTES)  # the script sets it
    out = tmp_path / "ttft.json"
    input_logprob_ttft.main(["--preset", "tiny-qwen3", "--prompts", "24", "--bucket", "32", "--reps", "1",
                             "--block-bytes", "32768,262144", "--out", str(out)])
    res = json.loads(out.read_text())
    assert [e["block_tokens"] for e in res["engines"].values()] == [16, 128]  # vocabulary 512, float32
    for eng in res["engines"].values():
        kinds = eng["prompts"]["24"]
        assert set(kinds) == {"none", "input", "input_top5"}
        assert all(k["median_ms"] > 0 and len(k["ms"]) == 1 for k in kinds.values())
