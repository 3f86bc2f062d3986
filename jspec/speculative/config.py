"""Speculative-decoding settings (SGLang's keyword names) and their validation.

Implemented: STANDALONE (any supported dense model as the drafter, same vocabulary), NGRAM
(drafts from the request's own tokens, matched on the device), the hidden-state drafters EAGLE,
EAGLE3 and NEXTN (MTP), and the DFlash block drafter (DFLASH: one forward drafts a block), with
chains and (EAGLE family) trees, greedy and sampling acceptance, hybrid (Gated-DeltaNet) targets,
the overlapped loop (spec v2, every algorithm) or, with disable_overlap_schedule, the synchronous
one (spec v1). Everything else the keywords can ask for raises ConfigError naming the
setting, so nothing runs with a silently different algorithm.
"""

from __future__ import annotations

import dataclasses

from jspec.errors import ConfigError

ALGORITHMS = ("EAGLE", "EAGLE3", "NEXTN", "STANDALONE", "NGRAM", "DFLASH", "NAIVE_EAGLE")
# NAIVE_EAGLE: an EAGLE / EAGLE3 head (format read from the draft's config.json) or, without a
# draft path, the target's MTP layer, fixed at one draft token per step (2 verified tokens), so
# one fused function verifies, accepts, extends the drafter and drafts the next token.
POLICY_KEYS = ("speculative_adaptive", "speculative_disable_by_batch_size")
HIDDEN_STATE_DRAFTERS = ("EAGLE", "EAGLE3", "NEXTN", "NAIVE_EAGLE")
MTP_FAMILIES = ("qwen3_next", "qwen3_5", "qwen3_5_moe")


@dataclasses.dataclass(frozen=True)
class SpecConfig:
    algorithm: str
    num_steps: int  # S: draft forwards per step
    topk: int
    num_draft_tokens: int  # tokens verified per request per step: S + 1 for a chain
    draft_model_path: str | None
    ngram_min_window: int = 1
    ngram_max_window: int = 12
    simulate_accept_length: float | None = None  # benchmark only: forced mean accept length
    # Per step, decode plainly when speculating would be slower (jspec.runtime.adaptive); and
    # vLLM's cap: never speculate with this many running requests or more.
    adaptive: bool = True
    disable_by_batch_size: int | None = None

    @property
    def verify_tokens(self) -> int:
        return self.num_draft_tokens

    @property
    def kv_ahead(self) -> int:
        """KV indices past a request's length that one speculative step may write (pages for
        them are allocated before the step): the verified tokens, and for a tree also the draft
        tree and the drafter's catch-up over the accepted path; DFLASH also the next draft block,
        which starts after the last accepted token."""
        if self.algorithm == "DFLASH":
            return 2 * self.num_draft_tokens - 1
        if self.topk == 1:
            return self.num_draft_tokens
        return max(self.num_draft_tokens, (self.num_steps - 1) * self.topk, self.num_steps + 1)

    @property
    def prefill_ahead(self) -> int:
        """KV indices past a finished prompt that its last prefill step writes: DFlash drafts its
        first block there (the drafter's cache only)."""
        return self.num_draft_tokens if self.algorithm == "DFLASH" else 0

    @property
    def draft_kind(self) -> str:
        """"eagle" (reads target hidden states), "dflash" (reads them as block context), "model"
        (STANDALONE) or "ngram" (matches the request's token history; no draft weights)."""
        if self.algorithm in HIDDEN_STATE_DRAFTERS:
            return "eagle"
        if self.algorithm == "DFLASH":
            return "dflash"
        return "model" if self.algorithm == "STANDALONE" else "ngram"


def parse_spec_config(kwargs: dict, *, target_family: str, target_is_hybrid: bool,
                      draft_block_size: int | None = None) -> SpecConfig | None:
    """draft_block_size: DFLASH's trained block size, read from the draft (the default block)."""
    algo = kwargs.get("speculative_algorithm")
    if algo is None:
        extra = [k for k in kwargs if k.startswith("speculative_") and kwargs[k] is not None
                 and k not in POLICY_KEYS]  # the policy knobs mean nothing without speculation: ignored
        if extra:
            raise ConfigError(f"{extra[0]} is set but speculative_algorithm is not")
        return None
    if not isinstance(algo, str) or algo.upper() not in ALGORITHMS:
        raise ConfigError(f"speculative_algorithm={algo!r}: choose from {', '.join(ALGORITHMS)}")
    algo = algo.upper()
    steps = kwargs.get("speculative_num_steps")
    topk = kwargs.get("speculative_eagle_topk")
    ndt = kwargs.get("speculative_num_draft_tokens")
    if algo == "NAIVE_EAGLE":
        for name, v, want in (("speculative_num_steps", steps, 1), ("speculative_eagle_topk", topk, 1),
                              ("speculative_num_draft_tokens", ndt, 2)):
            if v is not None and v != want:
                raise ConfigError(f"{name}={v!r}: NAIVE_EAGLE drafts one token per step ({name} must be {want})")
        steps, topk, ndt = 1, 1, 2
    if algo == "DFLASH":
        # SGLang: speculative_num_draft_tokens is the block size; a block drafts all but its first token.
        if topk not in (None, 1):
            raise ConfigError(f"speculative_eagle_topk={topk!r}: DFLASH drafts one block, a chain (topk 1)")
        block = draft_block_size or 16
        ndt = block if ndt is None and steps is None else ndt
        ndt = steps + 1 if ndt is None else ndt
        steps = ndt - 1 if steps is None and isinstance(ndt, int) else steps
        topk = 1
        if draft_block_size is not None and isinstance(ndt, int) and ndt > draft_block_size:
            raise ConfigError(f"speculative_num_draft_tokens={ndt} exceeds the DFlash drafter's block_size="
                              f"{draft_block_size}")
    if steps is None and topk is None and ndt is None:
        # SGLang's defaults when all are unset: 3 / 1 / 4, and 5 / 4 / 8 for Llama targets.
        steps, topk, ndt = (5, 4, 8) if target_family == "llama" and algo in HIDDEN_STATE_DRAFTERS else (3, 1, 4)
    steps = 3 if steps is None else steps
    topk = 1 if topk is None else topk
    ndt = (steps + 1 if topk == 1 else min(topk * steps + 1, 8)) if ndt is None else ndt
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
    if topk != 1 and algo not in HIDDEN_STATE_DRAFTERS:
        raise ConfigError(f"speculative_eagle_topk={topk}: draft trees need an EAGLE-family drafter "
                          f"({', '.join(HIDDEN_STATE_DRAFTERS)}); {algo} drafts a chain (topk 1)")
    sim = kwargs.get("speculative_simulate_accept_length")
    if sim is not None:
        if isinstance(sim, bool) or not isinstance(sim, (int, float)) or not 1.0 <= sim <= steps + 1:
            raise ConfigError(f"speculative_simulate_accept_length={sim!r}: must be a number in "
                              f"[1, speculative_num_steps + 1 = {steps + 1}]")
        sim = float(sim)
    draft = kwargs.get("speculative_draft_model_path")
    if algo in ("STANDALONE", "EAGLE", "EAGLE3", "DFLASH") and not draft:
        raise ConfigError(f"speculative_draft_model_path is required for {algo}")
    if (algo == "NEXTN" or (algo == "NAIVE_EAGLE" and not draft)) and target_family not in MTP_FAMILIES:
        raise ConfigError(f"speculative_algorithm='NEXTN': a {target_family} target has no MTP layer "
                          f"(NEXTN serves {', '.join(MTP_FAMILIES)})")
    lo = kwargs.get("speculative_ngram_min_match_window_size")
    hi = kwargs.get("speculative_ngram_max_match_window_size")
    lo, hi = (1 if lo is None else lo), (12 if hi is None else hi)
    if algo == "NGRAM":
        if draft:
            raise ConfigError("speculative_draft_model_path: NGRAM uses no draft model")
        if not (isinstance(lo, int) and isinstance(hi, int) and 1 <= lo <= hi):
            raise ConfigError("speculative_ngram_min_match_window_size / speculative_ngram_max_match_window_size: "
                              f"need 1 <= min <= max, got {lo!r} / {hi!r}")
    adaptive = kwargs.get("speculative_adaptive")
    adaptive = True if adaptive is None else adaptive
    if not isinstance(adaptive, bool):
        raise ConfigError(f"speculative_adaptive={adaptive!r}: must be True or False")
    cap = kwargs.get("speculative_disable_by_batch_size")
    if cap is not None and (isinstance(cap, bool) or not isinstance(cap, int) or cap < 1):
        raise ConfigError(f"speculative_disable_by_batch_size={cap!r}: must be a positive int (or None)")
    return SpecConfig(algorithm=algo, num_steps=steps, topk=topk, num_draft_tokens=ndt, draft_model_path=draft,
                      ngram_min_window=lo, ngram_max_window=hi, simulate_accept_length=sim, adaptive=adaptive,
                      disable_by_batch_size=cap)


def check_draft(spec: SpecConfig, target_cfg, draft_cfg) -> None:
    if draft_cfg.vocab_size != target_cfg.vocab_size:
        raise ConfigError(f"speculative_draft_model_path: draft vocabulary {draft_cfg.vocab_size} differs from the "
                          f"target's {target_cfg.vocab_size}")
    if draft_cfg.is_hybrid:
        raise ConfigError("speculative_draft_model_path: hybrid Gated-DeltaNet drafters are not implemented yet")
