"""Incremental detokenization and stop strings.

Decoding a growing output from scratch every step is quadratic; instead each request keeps two
offsets and decodes only a short window: the text of `ids[prefix:]` minus the text of
`ids[prefix:read]` is what the newest tokens added. A window ending in an incomplete UTF-8
sequence (U+FFFD) waits for the next token.
"""

from __future__ import annotations

import dataclasses


@dataclasses.dataclass
class DetokState:
    prefix_offset: int = 0
    read_offset: int = 0
    text: str = ""


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None or not ids:
            return ""
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def step(self, state: DetokState, ids: list[int], skip_special_tokens: bool = True) -> str:
        """Append the text of tokens `ids[state.read_offset:]`; returns the new piece. A call with
        no new token changes nothing (moving the window on would drop the context, such as the
        separator, that the next token's text depends on)."""
        if self.tokenizer is None or len(ids) <= state.read_offset:
            return ""
        prefix_text = self.decode(ids[state.prefix_offset:state.read_offset], skip_special_tokens)
        full = self.decode(ids[state.prefix_offset:], skip_special_tokens)
        if full.endswith("\ufffd") or len(full) < len(prefix_text):
            return ""
        piece = full[len(prefix_text):]
        state.prefix_offset = state.read_offset
        state.read_offset = len(ids)
        state.text += piece
        return piece


def find_stop(text: str, stops: list[str], search_from: int) -> tuple[int, str] | None:
    """Earliest stop string occurring in `text` at or after `search_from` (minus its length)."""
    best = None
    for s in stops:
        i = text.find(s, max(0, search_from - len(s) + 1))
        if i >= 0 and (best is None or i < best[0]):
            best = (i, s)
    return best


def stop_prefix_len(text: str, stops: list[str]) -> int:
    """Length of the longest tail of `text` that begins a stop string (never a whole one): what a
    stream holds back, since the stop may still complete and cut the text there."""
    best = 0
    for s in stops:
        for n in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:n]):
                best = n
                break
    return best
