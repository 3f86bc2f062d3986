"""NGRAM drafting: propose the tokens that followed the latest earlier occurrence of the request's
own most recent tokens (prompt + output), longest matching window first.

Per request an index maps each n-gram (n in [min_window, max_window]) to the position where its
latest occurrence ends. It is updated incrementally as tokens arrive (O(max_window) per token), and
only n-grams ending before the newest token are indexed, so a lookup of the current suffix finds an
earlier occurrence, whose continuation is the draft.
"""

from __future__ import annotations


class NgramIndex:
    def __init__(self, min_window: int, max_window: int):
        self.min_window, self.max_window = min_window, max_window
        self.ends: dict[tuple, int] = {}
        self.indexed = 0  # n-grams ending at positions < indexed are in `ends`

    def _catch_up(self, ids: list[int]) -> None:
        # Index n-grams ending at every position before the newest token.
        for end in range(self.indexed, len(ids) - 1):
            for n in range(self.min_window, self.max_window + 1):
                if end - n + 1 < 0:
                    break
                self.ends[tuple(ids[end - n + 1:end + 1])] = end
        self.indexed = max(self.indexed, len(ids) - 1)

    def propose(self, ids: list[int], num_tokens: int) -> list[int]:
        """`num_tokens` draft tokens continuing `ids` (padded with the last token when short)."""
        self._catch_up(ids)
        draft: list[int] = []
        for n in range(min(self.max_window, len(ids)), self.min_window - 1, -1):
            end = self.ends.get(tuple(ids[len(ids) - n:]))
            if end is not None:
                draft = ids[end + 1:end + 1 + num_tokens]
                break
        # A short continuation still has to fill the fixed shape; the filler is only a guess that
        # verification rejects if wrong.
        filler = draft[-1] if draft else ids[-1]
        return (draft + [filler] * num_tokens)[:num_tokens]
