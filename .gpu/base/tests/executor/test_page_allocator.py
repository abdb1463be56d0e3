"""PageAllocator: page 0 never handed out, refcounts, LIFO free list, all-or-nothing allocation, evictor hook."""

from __future__ import annotations

import pytest

from executor.page_allocator import OutOfPagesError, PageAllocator


def test_hands_out_pages_1_to_n_minus_1_in_order_never_page_0():
    allocator = PageAllocator(6)
    assert allocator.capacity == 5 and allocator.num_free == 5 and allocator.num_used == 0
    assert allocator.allocate(5) == [1, 2, 3, 4, 5]
    assert allocator.num_free == 0 and allocator.num_used == 5
    allocator.check()


def test_allocation_is_all_or_nothing():
    allocator = PageAllocator(4)
    first = allocator.allocate(2)
    with pytest.raises(OutOfPagesError) as error:
        allocator.allocate(2)
    assert error.value.requested == 2 and error.value.available == 1
    assert allocator.num_free == 1 and allocator.num_used == 2  # unchanged
    assert allocator.allocate(0) == []
    allocator.release_all(first)
    allocator.check()


def test_free_list_is_lifo():
    allocator = PageAllocator(8)
    pages = allocator.allocate(4)  # 1 2 3 4
    allocator.release(pages[1])
    allocator.release(pages[3])
    assert allocator.allocate(1) == [4]  # freed last, handed out first
    assert allocator.allocate(1) == [2]
    assert allocator.allocate(1) == [5]  # then the never-used pages in order


def test_refcounts_retain_and_release():
    allocator = PageAllocator(4)
    (page,) = allocator.allocate(1)
    allocator.retain(page)
    allocator.retain(page)
    assert allocator.refcount(page) == 3 and allocator.num_used == 1
    allocator.release(page)
    allocator.release(page)
    assert allocator.refcount(page) == 1 and allocator.num_free == 2
    allocator.release(page)
    assert allocator.refcount(page) == 0 and allocator.is_free(page) and allocator.num_free == 3
    allocator.check()


@pytest.mark.parametrize("bad", [0, -1, 4, 100])
def test_page_ids_outside_the_pool_are_errors(bad):
    allocator = PageAllocator(4)
    with pytest.raises(ValueError):
        allocator.retain(bad)
    with pytest.raises(ValueError):
        allocator.release(bad)


def test_misuse_is_an_error_not_a_silent_corruption():
    allocator = PageAllocator(4)
    (page,) = allocator.allocate(1)
    allocator.release(page)
    with pytest.raises(ValueError):
        allocator.release(page)  # double free
    with pytest.raises(ValueError):
        allocator.retain(page)  # retain a free page
    with pytest.raises(ValueError):
        allocator.allocate(-1)
    allocator.check()


@pytest.mark.parametrize("num_pages", [0, 1])
def test_a_pool_without_usable_pages(num_pages):
    allocator = PageAllocator(num_pages)
    assert allocator.capacity == 0 and allocator.num_available == 0
    assert allocator.allocate(0) == []
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)


class _FakeEvictor:
    """Keeps every unreferenced page; evicts in release order."""

    def __init__(self):
        self.kept: list[int] = []

    @property
    def num_evictable(self) -> int:
        return len(self.kept)

    def on_unreferenced(self, page: int) -> bool:
        self.kept.append(page)
        return True

    def on_referenced(self, page: int) -> None:
        self.kept.remove(page)

    def evict(self, count: int) -> list[int]:
        out, self.kept = self.kept[:count], self.kept[count:]
        return out


def test_evictor_keeps_released_pages_and_gives_them_back_on_shortage():
    allocator = PageAllocator(5)
    evictor = _FakeEvictor()
    allocator.set_evictor(evictor)
    pages = allocator.allocate(4)
    allocator.release(pages[2])
    allocator.release(pages[0])
    assert allocator.num_free == 0 and allocator.num_cached == 2 and allocator.num_available == 2
    allocator.retain(pages[0])  # a cached page reused: no longer evictable
    assert allocator.num_cached == 1 and allocator.refcount(pages[0]) == 1
    allocator.check()
    assert allocator.allocate(1) == [pages[2]]  # free list empty: the evictor gives one back
    with pytest.raises(OutOfPagesError):
        allocator.allocate(1)
    allocator.check()
    with pytest.raises(ValueError):
        allocator.set_evictor(_FakeEvictor())
