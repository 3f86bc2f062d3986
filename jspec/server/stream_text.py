"""The text of a streamed request, chunk by chunk, so that the pieces add up to exactly the text a
non-streamed request gets.

Why not the engine's own streamed pieces: a piece may end in the first characters of a stop string
(`stop=["\\n\\n"]`, a piece ending in one "\\n"); once the stop completes, the final text is cut
before it, and text already sent cannot be taken back. So this tracker decodes the tokens itself,
with the engine's incremental detokenizer and stop search called the way the engine calls them
(token by token when stop strings are set, so it finds the same stop at the same place), holds back any tail that could
still grow into a stop string, and at the end produces the engine's final text: the text cut at
the stop string, or the whole output decoded (`Engine.generate`'s rule).
"""

from __future__ import annotations

from jspec.runtime.detokenizer import DetokState, Detokenizer, find_stop, stop_prefix_len


class StreamText:
    """Feed it each chunk's new token ids (`add`); `delta()` is the text that may be sent now,
    `finish(finish_reason)` the rest once the request is done. `text` is what was sent so far."""

    def __init__(self, tokenizer, *, stop=None, skip_special_tokens: bool = True):
        self.detok = Detokenizer(tokenizer)
        self.state = DetokState()
        self.skip = skip_special_tokens
        self.stops = [stop] if isinstance(stop, str) else list(stop or [])
        self.ids: list[int] = []
        self.stop_end: int | None = None  # where a matched stop string starts
        self.text = ""

    def add(self, new_ids) -> None:
        if not self.stops:
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
            if self.stops:
                hit = find_stop(self.state.text, self.stops, before)
                if hit is not None:
                    self.stop_end = hit[0]

    def delta(self) -> str:
        """New text that no later token can take back."""
        visible = self.state.text if self.stop_end is None else self.state.text[:self.stop_end]
        visible = visible[:len(visible) - stop_prefix_len(visible, self.stops)]
        return self._send(visible)

    def finish(self, finish_reason) -> str:
        """The rest of the final text. finish_reason: the engine's (a stop string match is
        `{"type": "stop", "matched": "<the string>"}`)."""
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
