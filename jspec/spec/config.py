"""Speculative-decoding settings (SGLang's keyword names) and their validation.

Implemented so far: STANDALONE (any supported dense model as the drafter, same vocabulary) and
NGRAM (drafts from the request's own tokens), with a chain (topk 1), greedy acceptance, the
synchronous loop. Everything else the keywords can ask for
raises ConfigError naming the setting, so nothing runs with a silently different algorithm.
"""

from __future__ import annotations

import dataclasses

from jspec.errors import ConfigError

ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "NAIVE_EAGLE")
IMPLEMENTED = ("STANDALONE", "NGRAM")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    num_steps: int  # S: draft forwards per step
    topk: int
    num_draft_tokens: int  # tokens verified per request per step: S + 1 for a chain
    draft_model_path: str | None
    ngram_min_window: int = 1
    ngram_max_window: int = 12

    @property
    def verify_tokens(self) -> int:
        return self.num_draft_tokens


def parse_spec_config(kwargs: dict, *, target_family: str, target_is_hybrid: bool) -> SpecConfig | None:
    algo = kwargs.get("speculative_algorithm")
    if algo is None:
        extra = [k for k in kwargs if k.startswith("speculative_") and kwargs[k] is not None]
        if extra:
            raise ConfigError(f"{extra[0]} is set but speculative_algorithm is not")
        return None
    if not isinstance(algo, str) or algo.upper() not in ALGORITHMS:
        raise ConfigError(f"speculative_algorithm={algo!r}: choose from {', '.join(ALGORITHMS)}")
    algo = algo.upper()
    if algo not in IMPLEMENTED:
        raise ConfigError(f"speculative_algorithm={algo!r} is not implemented yet (implemented: {IMPLEMENTED})")
    steps = kwargs.get("speculative_num_steps")
    topk = kwargs.get("speculative_eagle_topk")
    ndt = kwargs.get("speculative_num_draft_tokens")
    # SGLang's defaults when unset: 3 steps, topk 1, 4 draft tokens.
    steps = 3 if steps is None else steps
    topk = 1 if topk is None else topk
    ndt = steps + 1 if ndt is None else ndt
    for name, v in (("speculative_num_steps", steps), ("speculative_eagle_topk", topk),
                    ("speculative_num_draft_tokens", ndt)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ConfigError(f"{name} must be a positive int, got {v!r}")
    if topk == 1 and ndt != steps + 1:
        raise ConfigError(
            f"speculative_num_draft_tokens={ndt} must equal speculative_num_steps + 1 = {steps + 1} when "
            "speculative_eagle_topk is 1 (a chain)"
        )
    if ndt > topk * steps + 1:
        raise ConfigError(f"speculative_num_draft_tokens={ndt} exceeds speculative_eagle_topk * "
                          f"speculative_num_steps + 1 = {topk * steps + 1}")
    if topk != 1:
        raise ConfigError(f"speculative_eagle_topk={topk}: tree drafting is not implemented yet (only 1)")
    if target_is_hybrid:
        raise ConfigError(f"speculative decoding on hybrid Gated-DeltaNet targets ({target_family}) is not "
                          "implemented yet")
    if kwargs.get("speculative_simulate_accept_length") is not None:
        raise ConfigError("speculative_simulate_accept_length is not implemented yet")
    draft = kwargs.get("speculative_draft_model_path")
    if algo == "STANDALONE" and not draft:
        raise ConfigError("speculative_draft_model_path is required for STANDALONE")
    lo = kwargs.get("speculative_ngram_min_match_window_size")
    hi = kwargs.get("speculative_ngram_max_match_window_size")
    lo, hi = (1 if lo is None else lo), (12 if hi is None else hi)
    if algo == "NGRAM":
        if draft:
            raise ConfigError("speculative_draft_model_path: NGRAM uses no draft model")
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError("speculative_ngram_min_match_window_size / speculative_ngram_max_match_window_size: "
                              f"need 1 <= min <= max, got {lo!r} / {hi!r}")
    return SpecConfig(algorithm=algo, num_steps=steps, topk=topk, num_draft_tokens=ndt, draft_model_path=draft,
                      ngram_min_window=lo, ngram_max_window=hi)


def check_draft(spec: SpecConfig, target_cfg, draft_cfg) -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"speculative_draft_model_path: draft vocabulary {draft_cfg.vocab_size} differs from the "
                          f"target's {target_cfg.vocab_size}")
    if draft_cfg.is_hybrid:
        raise ConfigError("speculative_draft_model_path: hybrid Gated-DeltaNet drafters are not implemented yet")
