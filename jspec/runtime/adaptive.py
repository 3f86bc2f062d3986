"""Whether a speculative engine's next decode step speculates: speculation that never loses.

A speculative step of batch bucket B takes t_spec(B) and yields the running accept length A tokens
per request; a plain step (the drafter kept current, `jspec.speculative.plain_step`) takes
t_plain(B) and yields one. Speculating pays iff A / t_spec(B) > 1 / t_plain(B). Both times are
measured per bucket when the engine starts (`ModelRunner.time_decode_steps`); A is a running
average over the speculative steps' outputs. At small batches a verify forward costs about what a
decode does (memory-bound), so speculation wins; at large batches it is compute-bound and the
ratio t_spec / t_plain approaches the tokens verified per request, so it stops paying.

While it decodes plainly the engine learns nothing new about A, so every `probe_every`-th such
step speculates anyway. `speculative_disable_by_batch_size` (vLLM's knob) is a hard cap on top.
"""

from __future__ import annotations

import dataclasses

EMA = 0.1  # weight of the newest step in the running accept length


@dataclasses.dataclass
class SpecPolicy:
    adaptive: bool = True
    disable_by_batch_size: int | None = None
    probe_every: int = 16
    step_times: dict[int, tuple[float, float]] = dataclasses.field(default_factory=dict)  # B -> (plain, spec) s
    accept_length: float | None = None  # running mean tokens per request per speculative step
    num_spec_steps: int = 0
    num_plain_steps: int = 0
    _plain_run: int = 0
    choices: dict[int, dict[str, int]] = dataclasses.field(default_factory=dict)  # B -> {"spec": n, "plain": n}

    def pays(self, batch_bucket: int) -> bool:
        """Whether speculating is faster at this bucket, on what is known now (True until known)."""
        times = self.step_times.get(batch_bucket)
        if times is None or self.accept_length is None:
            return True
        t_plain, t_spec = times
        return self.accept_length * t_plain > t_spec

    def speculate(self, batch_bucket: int, num_requests: int) -> bool:
        """The choice for one decode step of num_requests requests padded to batch_bucket."""
        if self.disable_by_batch_size is not None and num_requests >= self.disable_by_batch_size:
            choice = False
        elif not self.adaptive:
            choice = True
        else:
            choice = self.pays(batch_bucket) or self._plain_run + 1 >= self.probe_every
        self._plain_run = 0 if choice else self._plain_run + 1
        if choice:
            self.num_spec_steps += 1
        else:
            self.num_plain_steps += 1
        counts = self.choices.setdefault(batch_bucket, {"spec": 0, "plain": 0})
        counts["spec" if choice else "plain"] += 1
        return choice

    def observe(self, tokens_per_request: list[int]) -> None:
        """A speculative step's output: tokens each real request got (accepted drafts + bonus)."""
        if not tokens_per_request:
            return
        mean = sum(tokens_per_request) / len(tokens_per_request)
        self.accept_length = mean if self.accept_length is None else (1 - EMA) * self.accept_length + EMA * mean

    def info(self) -> dict:
        return dict(speculative_adaptive=self.adaptive, speculative_disable_by_batch_size=self.disable_by_batch_size,
                    running_accept_length=self.accept_length, num_spec_steps=self.num_spec_steps,
                    num_plain_steps=self.num_plain_steps,
                    step_times_ms={b: {"plain": round(p * 1e3, 4), "spec": round(s * 1e3, 4),
                                       "speculate": self.pays(b)} for b, (p, s) in sorted(self.step_times.items())},
                    choices_by_batch=dict(sorted(self.choices.items())))
