"""Host allocators over the device pools: KV pages and request slots.

Both hand out indices into device arrays and never touch the arrays themselves; the scheduler
owns the calls. Index 0 of each is never handed out: padding tokens and padding requests point at
it (the sink), so a stray write from a padded row lands somewhere harmless.

- `PageAllocator`: pages of the paged KV pool. Pages carry reference counts so a prefix cache can
  share them; `free` drops one reference and returns the page to the free list at zero.
- `SlotAllocator`: the row a running request owns in every per-request device buffer (page table,
  last sampled token, penalty counts, GDN state pool, a drafter's carried state).
"""

from __future__ import annotations

from collections import deque

SINK_PAGE = 0
SINK_SLOT = 0


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


class SlotAllocator:
    def __init__(self, num_slots: int):
        if num_slots < 2:
            raise ValueError(f"num_slots must be >= 2 (slot 0 is the padding sink), got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, 0, -1))  # pop() hands out low slots first
        self._used: set[int] = set()

    @property
    def num_free(self) -> int:
        return len(self._free)

    def alloc(self) -> int | None:
        if not self._free:
            return None
        s = self._free.pop()
        self._used.add(s)
        return s

    def free(self, slot: int) -> None:
        if slot not in self._used:
            raise ValueError(f"slot {slot} freed but not allocated")
        self._used.remove(slot)
        self._free.append(slot)

    def check_all_free(self) -> None:
        if self._used:
            raise AssertionError(f"slots still allocated: {sorted(self._used)[:16]}")
