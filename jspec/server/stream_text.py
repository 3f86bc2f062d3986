"""The text of a streamed request, chunk by chunk, so that the pieces add up to exactly the text a
non-streamed request gets.

Why not the engine's own streamed pieces: a piece may end in the first characters of a stop string
(`stop=["\\n\\n"]`, a piece ending in one "\\n"); once the stop completes, the final text is cut
before it, and text already sent cannot be taken back. So this tracker decodes the tokens itself,
with the engine's incremental detokenizer and stop search called the way the engine calls them
(token by token when stop strings or stop regexes are set, so it finds the same stop at the same
place), holds back any tail that could still grow into a stop, and at the end produces the
engine's final text: the text cut at the stop, or the whole output decoded (`Engine.generate`'s
rule; always so under `no_stop_trim`, which keeps the stop in the text).
"""

from __future__ import annotations

from jspec.runtime.detokenizer import DetokState, Detokenizer, first_stop, safe_prefix


class StreamText:
    """Feed it each chunk's new token ids (`add`); `delta()` is the text that may be sent now,
    `finish(finish_reason)` the rest once the request is done. `text` is what was sent so far."""

    def __init__(self, tokenizer, *, stop=None, stop_regex=None, no_stop_trim: bool = False,
                 min_new_tokens: int = 0, skip_special_tokens: bool = True):
        """stop, stop_regex, no_stop_trim, min_new_tokens, skip_special_tokens: the request's
        sampling keys (a stop kept in the text cuts nothing, so it is not searched; none counts
        before min_new_tokens tokens, as in the engine)."""
        self.detok = Detokenizer(tokenizer)
        self.state = DetokState()
        self.skip = skip_special_tokens
        listed = lambda x: [] if no_stop_trim else [x] if isinstance(x, str) else list(x or [])  # noqa: E731
        self.stops, self.patterns = listed(stop), listed(stop_regex)
        self.min_new = min_new_tokens
        self.ids: list[int] = []
        self.stop_end: int | None = None  # where a matched stop starts
        self.text = ""

    def add(self, new_ids) -> None:
        if not (self.stops or self.patterns):
            # Nothing can cut the text: one detokenizer step per chunk (the final text is the whole
            # output decoded anyway), which saves per-token work in speculative chunks.
            self.ids.extend(int(t) for t in new_ids)
            self.detok.step(self.state, self.ids, self.skip)
            return
        for tok in new_ids:
            self.ids.append(int(tok))
            if self.stop_end is not None:
                continue
            before = len(self.state.text)
            self.detok.step(self.state, self.ids, self.skip)
            hit = None if len(self.ids) < self.min_new else first_stop(self.state.text, self.stops, self.patterns,
                                                                       before)
            if hit is not None:
                self.stop_end = hit[0]

    def delta(self) -> str:
        """New text that no later token can take back."""
        visible = self.state.text if self.stop_end is None else self.state.text[:self.stop_end]
        return self._send(safe_prefix(visible, self.stops, self.patterns, len(self.text)))

    def finish(self, finish_reason) -> str:
        """The rest of the final text. finish_reason: the engine's (a stop string or stop-regex
        match is `{"type": "stop", "matched": "<the text>"}`)."""
        matched = finish_reason.get("matched") if isinstance(finish_reason, dict) else None
        if isinstance(matched, str) and self.stop_end is not None:
            final = self.state.text[:self.stop_end]
        else:
            final = self.detok.decode(self.ids, self.skip)
        return self._send(final)

    def _send(self, upto: str) -> str:
        # Text only grows; a shorter or different text (not expected) sends nothing rather than
        # repeating what the client already has.
        if len(upto) <= len(self.text) or not upto.startswith(self.text):
            return ""
        piece, self.text = upto[len(self.text):], upto
        return piece
