"""Host allocator over the paged KV pool.

Page 0 is never handed out: padding tokens and padding requests point at it, so a stray write from
a padded row lands somewhere harmless. Pages carry reference counts so a later prefix cache can
share them; `free` drops one reference and returns the page to the free list at zero.
"""

from __future__ import annotations

from collections import deque

SINK_PAGE = 0


class OutOfPages(Exception):
    """Raised by `alloc` when the pool cannot satisfy a request (the scheduler retracts instead)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int):
        if num_pages < 2:
            raise ValueError(f"num_pages must be >= 2 (page 0 is the padding sink), got {num_pages}")
        self.num_pages = num_pages
        self.page_size = page_size
        self._free = deque(range(1, num_pages))
        self._refs = [0] * num_pages

    @property
    def num_usable(self) -> int:
        return self.num_pages - 1

    @property
    def num_free(self) -> int:
        return len(self._free)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def alloc(self, n: int) -> list[int]:
        if n > len(self._free):
            raise OutOfPages(f"asked for {n} pages, {len(self._free)} free")
        out = [self._free.popleft() for _ in range(n)]
        for p in out:
            self._refs[p] = 1
        return out

    def share(self, pages: list[int]) -> None:
        for p in pages:
            if self._refs[p] <= 0:
                raise ValueError(f"page {p} is not allocated")
            self._refs[p] += 1

    def free(self, pages: list[int]) -> None:
        for p in pages:
            if p == SINK_PAGE or self._refs[p] <= 0:
                raise ValueError(f"page {p} freed but not allocated")
            self._refs[p] -= 1
            if self._refs[p] == 0:
                self._free.append(p)

    def check_all_free(self) -> None:
        """The leak invariant: every usable page is back on the free list."""
        leaked = [p for p in range(1, self.num_pages) if self._refs[p] != 0]
        if leaked or len(self._free) != self.num_usable:
            raise AssertionError(f"pages still allocated: {leaked[:16]} (free {len(self._free)}/{self.num_usable})")
