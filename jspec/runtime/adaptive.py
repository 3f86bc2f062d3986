"""How many drafts a speculative engine's next decode step verifies: speculation that never loses.

A step of batch bucket B that drafts k tokens per request (k = 0: a plain step that keeps the
drafter current, `jspec.speculative.plain_step`) takes t_k(B) and yields E(k) = 1 + P(n >= 1) +
... + P(n >= k) tokens per request, n being the drafts the target keeps. The policy picks the k
with the most tokens per second, E(k) / t_k(B), among the variants compiled for the engine: plain,
the configured chain and, for a hidden-state chain drafter, shorter chains. The times are measured
per bucket when the engine starts (`startup_runs.time_decode_steps`); each P(n >= i) is a running
average over the steps that drafted at least i tokens (in a chain, whether the first i drafts are
kept does not depend on how many follow). At small batches a verify costs about what a decode does
(memory-bound), so the longest chain wins; at large batches verify is compute-bound, its time grows
with the tokens verified, and shorter chains, then plain steps, take over.

Choosing fewer drafts than configured teaches the policy nothing about the later positions, so
every `probe_every`-th such step drafts the full chain. `speculative_disable_by_batch_size` (vLLM's
knob) is a hard cap on top: at or above it every step is plain.
"""

from __future__ import annotations

import dataclasses

EMA = 0.1  # weight of the newest step in the running averages


@dataclasses.dataclass
class SpecPolicy:
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    max_drafts: int = 1  # the configured chain: drafts per request of a full speculative step
    probe_every: int = 16
    step_times: dict[int, dict[int, float]] = dataclasses.field(default_factory=dict)  # B -> {k: seconds}
    accept_length: float | None = None  # running mean tokens per request per speculative step
    kept_at_least: list = dataclasses.field(default_factory=list)  # [i-1]: running P(n >= i), None unseen
    num_spec_steps: int = 0
    num_plain_steps: int = 0
    _short_run: int = 0
    choices: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)  # B -> {choice: n}

    def __post_init__(self):
        if not self.kept_at_least:
            self.kept_at_least = [None] * self.max_drafts

    def expected_tokens(self, k: int) -> float | None:
        """E(k), tokens per request of a k-draft step; None while a position is still unseen."""
        seen = self.kept_at_least[:k]
        return None if any(p is None for p in seen) else 1.0 + sum(seen)

    def best(self, batch_bucket: int) -> int:
        """The k with the most tokens per second at this bucket (the full chain until known)."""
        times = self.step_times.get(batch_bucket)
        if not times or self.expected_tokens(self.max_drafts) is None:
            return self.max_drafts
        return max(sorted(times), key=lambda k: self.expected_tokens(k) / times[k])

    def pays(self, batch_bucket: int) -> bool:
        """Whether speculating at all beats plain decoding at this bucket."""
        return self.best(batch_bucket) > 0

    def choose(self, batch_bucket: int, num_requests: int) -> int:
        """Drafts per request for one decode step of num_requests requests padded to batch_bucket
        (0: a plain step; max_drafts: the configured chain)."""
        if self.disable_by_batch_size is not None and num_requests >= self.disable_by_batch_size:
            k = 0
        elif not self.adaptive:
            k = self.max_drafts
        else:
            k = self.best(batch_bucket)
            if k < self.max_drafts and self._short_run + 1 >= self.probe_every:
                k = self.max_drafts  # probe: learn the later positions again
        self._short_run = 0 if k == self.max_drafts else self._short_run + 1
        if k:
            self.num_spec_steps += 1
        else:
            self.num_plain_steps += 1
        counts = self.choices.setdefault(batch_bucket, {})
        name = "plain" if k == 0 else "spec" if k == self.max_drafts else f"drafts_{k}"
        counts[name] = counts.get(name, 0) + 1
        return k

    def speculate(self, batch_bucket: int, num_requests: int) -> bool:
        return self.choose(batch_bucket, num_requests) > 0

    def observe(self, tokens_per_request: list[int], num_drafts: int | None = None) -> None:
        """A speculative step's output: tokens each real request got (kept drafts + bonus), from a
        step that drafted num_drafts per request (default: the configured chain)."""
        if not tokens_per_request:
            return
        k = self.max_drafts if num_drafts is None else num_drafts
        mean = sum(tokens_per_request) / len(tokens_per_request)
        self.accept_length = mean if self.accept_length is None else (1 - EMA) * self.accept_length + EMA * mean
        for i in range(1, min(k, self.max_drafts) + 1):
            frac = sum(t - 1 >= i for t in tokens_per_request) / len(tokens_per_request)
            old = self.kept_at_least[i - 1]
            self.kept_at_least[i - 1] = frac if old is None else (1 - EMA) * old + EMA * frac

    def info(self) -> dict:
        def times(b):
            t = self.step_times[b]
            named = {("plain" if k == 0 else "spec" if k == self.max_drafts else f"drafts_{k}"): round(s * 1e3, 4)
                     for k, s in sorted(t.items())}
            return {**named, "speculate": self.pays(b), "best_num_drafts": self.best(b)}

        return dict(speculative_adaptive=self.adaptive, speculative_disable_by_batch_size=self.disable_by_batch_size,
                    running_accept_length=self.accept_length,
                    kept_at_least=[None if p is None else round(p, 4) for p in self.kept_at_least],
                    num_spec_steps=self.num_spec_steps, num_plain_steps=self.num_plain_steps,
                    step_times_ms={b: times(b) for b in sorted(self.step_times)},
                    # A snapshot: a benchmark record keeps the counts of its own time.
                    choices_by_batch={b: dict(c) for b, c in sorted(self.choices.items())})
