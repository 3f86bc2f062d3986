"""Request slots: the row a running request owns in every per-request device buffer (page table,
last sampled token, penalty counts, GDN state pool). Slot 0 is the padding sink."""

from __future__ import annotations

SINK_SLOT = 0


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
