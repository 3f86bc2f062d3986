"""The host allocators over the device pools: pages (with reference counts) and request slots."""

from __future__ import annotations

import pytest

from jspec.cache.allocator import SINK_PAGE, SINK_SLOT, OutOfPages, PageAllocator, SlotAllocator


def test_pages_never_hand_out_the_sink_and_come_back_once_unreferenced():
    pages = PageAllocator(num_pages=5, page_size=4)
    assert pages.num_usable == 4 and pages.num_free == 4
    got = pages.alloc(4)
    assert SINK_PAGE not in got and sorted(got) == [1, 2, 3, 4]
    with pytest.raises(OutOfPages):
        pages.alloc(1)
    pages.share(got[:2])  # a second owner (a prefix cache) of two pages
    pages.free(got)
    assert pages.num_free == 2  # the shared two still have one reference each
    with pytest.raises(AssertionError, match="still allocated"):
        pages.check_all_free()
    pages.free(got[:2])
    pages.check_all_free()


def test_pages_refuse_double_free_sink_free_and_sharing_a_free_page():
    pages = PageAllocator(num_pages=3, page_size=2)
    (p,) = pages.alloc(1)
    pages.free([p])
    with pytest.raises(ValueError, match=f"page {p} freed but not allocated"):
        pages.free([p])
    with pytest.raises(ValueError):
        pages.free([SINK_PAGE])
    with pytest.raises(ValueError, match="not allocated"):
        pages.share([p])
    assert pages.pages_for(0) == 0 and pages.pages_for(1) == 1 and pages.pages_for(2) == 1 and pages.pages_for(3) == 2
    with pytest.raises(ValueError):
        PageAllocator(num_pages=1, page_size=2)


def test_slots_low_first_never_the_sink_and_none_when_exhausted():
    slots = SlotAllocator(num_slots=4)
    got = [slots.alloc() for _ in range(3)]
    assert got == [1, 2, 3] and SINK_SLOT not in got
    assert slots.alloc() is None and slots.num_free == 0
    slots.free(2)
    assert slots.alloc() == 2
    with pytest.raises(AssertionError, match="still allocated"):
        slots.check_all_free()
    for s in (1, 2, 3):
        slots.free(s)
    slots.check_all_free()
    with pytest.raises(ValueError, match="slot 1 freed but not allocated"):
        slots.free(1)
