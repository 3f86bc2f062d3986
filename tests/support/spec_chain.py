"""Shared set-up of the chain speculative-decoding tests (STANDALONE in test_spec_chain.py, NGRAM in
test_spec_ngram.py; two files so that `pytest -n 2 --dist loadfile` can run them side by side): the
tiny target and a draft of another architecture (the session fixtures `chain_dirs` and
`chain_reference` of tests/conftest.py), the prompts, and the settings."""

from __future__ import annotations

from tests.support import models as tm
from tests.support.engines import SPEC

BASE = SPEC
TARGET = ("qwen3", 41)
DRAFT = ("llama", 42)  # a different architecture, same vocabulary

# The last prompt plus 13 new tokens ends exactly at the context length (96): speculative steps
# there write draft positions past it, which the page table must cover.
PROMPTS = [tm.random_ids(n, seed=100 + n) for n in (5, 19, 11, 2, 14, 83)]
GREEDY = {"max_new_tokens": 13, "temperature": 0, "ignore_eos": True}
