"""Incremental detokenization, stop strings and stop regular expressions.

Decoding a growing output from scratch every step is quadratic; instead each request keeps two
offsets and decodes only a short window: the text of `ids[prefix:]` minus the text of
`ids[prefix:read]` is what the newest tokens added. A window ending in an incomplete UTF-8
sequence (U+FFFD) waits for the next token.

Stops are searched only where a match could end in the text the newest tokens added (a stop
string's length, a regular expression's longest match, `regex_reach`, before it), so a long
output is not scanned again at every token; a regular expression with no bound on its matches
is searched from the start.
"""

from __future__ import annotations

import dataclasses
import functools
import re

try:  # Python's own regex parser (private): what it tells only shortens searches (`regex_reach`)
    from re import _constants as _re_constants, _parser as _re_parser
except ImportError:  # pragma: no cover - a Python without it searches unbounded
    _re_parser = None


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


@functools.lru_cache(maxsize=256)
def regex_reach(pattern: str) -> int | None:
    """The most characters a match of `pattern` spans, or None when that is unbounded (or cannot
    be read: Python's own regex parser is private, so its absence only costs longer searches)."""
    if _re_parser is None:
        return None
    try:
        hi = _re_parser.parse(pattern).getwidth()[1]
    except Exception:  # noqa: BLE001 - any failure means "not known"
        return None
    return None if hi >= _re_constants.MAXREPEAT else int(hi)


def find_stop_regex(text: str, patterns, search_from: int) -> tuple[int, str] | None:
    """Leftmost match of any of `patterns` in `text` that may end at or after `search_from`:
    (its start, the matched text). An earlier match would have ended before `search_from`."""
    best = None
    for p in patterns:
        reach = regex_reach(p)
        m = re.compile(p).search(text, 0 if reach is None else max(0, search_from - reach + 1))
        if m is not None and (best is None or m.start() < best[0]):
            best = (m.start(), m.group(0))
    return best


def first_stop(text: str, stops, patterns, search_from: int) -> tuple[int, str] | None:
    """The earliest-starting stop string or stop-regex match that may end at or after
    `search_from`: (its start, the matched text), or None."""
    found = [f for f in (find_stop(text, stops, search_from), find_stop_regex(text, patterns, search_from))
             if f is not None]
    return min(found, default=None)


def stop_regex_hold(text: str, patterns) -> int:
    """Length of the tail of `text` where a match of `patterns` may still begin (the whole text
    for a pattern whose matches have no bound)."""
    if not patterns:
        return 0
    reaches = [regex_reach(p) for p in patterns]
    return len(text) if None in reaches else min(len(text), max(reaches) - 1)


def safe_prefix(now: str, stops, patterns=(), sent: int = 0) -> str:
    """What of a not-yet-final text may be sent: the text before the first whole stop string or
    stop-regex match (the engine may have matched it already and not yet said so), less a tail
    that may still grow into one. sent: how much of `now` was sent already, which holds no stop
    and no beginning of one (it was held back), so the search starts where a stop could end."""
    found = first_stop(now, stops, patterns, sent)
    now = now[:found[0]] if found else now
    return now[:len(now) - max(stop_prefix_len(now, stops), stop_regex_hold(now, patterns))]
