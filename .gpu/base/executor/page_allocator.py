"""Reference-counted KV pages of the planned pool (pure Python, no torch).

``PageAllocator(num_pages)`` hands out pages ``1 .. num_pages - 1``; page 0 is
the plan's padding page and is never handed out. ``num_pages`` is the plan's
``capacity.kv_pages``.

A page is in exactly one of three states:

- **free**: on the free list, refcount 0;
- **used**: refcount >= 1 (one count per request whose page table lists it);
- **cached**: refcount 0 but kept by an ``Evictor`` (the prefix cache) because
  its KV may be reused; the evictor gives it back when ``allocate`` runs short.

``num_used + num_free + num_cached == capacity`` (``= num_pages - 1``) at all
times; ``check()`` asserts it.

Policies:

- ``allocate(n)`` is all-or-nothing: it returns ``n`` pages (each with
  refcount 1) or raises ``OutOfPagesError`` and changes nothing. Callers that
  must not fail ask ``num_available`` (free + evictable) first.
- The free list is **LIFO**: the page freed last is handed out first (its
  lines are the most likely to still sit in L2). The initial order hands out
  1, 2, 3, ... so fresh runs are deterministic.
- When fewer than ``n`` pages are free, ``allocate`` asks the evictor for the
  shortfall; the evictor decides the order (the prefix cache: least recently
  unreferenced first) and may only give back pages with refcount 0.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol


class OutOfPagesError(RuntimeError):
    """``allocate(n)`` found fewer than ``n`` free or evictable pages."""

    def __init__(self, requested: int, available: int):
        self.requested = requested
        self.available = available
        super().__init__(f"kv_pages: need {requested} pages, {available} free or evictable")


class Evictor(Protocol):
    """What the allocator asks about pages whose refcount is 0 (implemented by ``PrefixCache``)."""

    @property
    def num_evictable(self) -> int:
        """Cached pages with refcount 0 that ``evict`` can give back."""

    def on_unreferenced(self, page: int) -> bool:
        """``page``'s refcount dropped to 0: return True to keep it cached (evictable), False to free it."""

    def on_referenced(self, page: int) -> None:
        """A cached page with refcount 0 is retained again: it is no longer evictable."""

    def evict(self, count: int) -> list[int]:
        """Forget at least ``count`` evictable pages and return them (each has refcount 0)."""


class PageAllocator:
    """Reference-counted pages 1..num_pages-1 with a LIFO free list and an optional evictor."""

    def __init__(self, num_pages: int):
        if num_pages < 0:
            raise ValueError(f"num_pages must be >= 0, got {num_pages}")
        self.num_pages = num_pages
        self._refcount = [0] * max(num_pages, 1)
        self._is_free = [False] + [True] * max(num_pages - 1, 0)
        # LIFO stack: pop() from the end, so reversed order hands out 1, 2, 3, ... first.
        self._free: list[int] = list(range(num_pages - 1, 0, -1))
        self._num_used = 0
        self._evictor: Evictor | None = None

    # ------------------------------------------------------------------ setup
    def set_evictor(self, evictor: Evictor | None) -> None:
        """Attach the cache that keeps unreferenced pages (at most one)."""
        if evictor is not None and self._evictor is not None and evictor is not self._evictor:
            raise ValueError("the allocator already has an evictor")
        self._evictor = evictor

    # ------------------------------------------------------------------ counts
    @property
    def capacity(self) -> int:
        """Pages that can ever be handed out: ``num_pages - 1`` (page 0 is padding)."""
        return max(self.num_pages - 1, 0)

    @property
    def num_free(self) -> int:
        """Pages on the free list (not counting cached, evictable pages)."""
        return len(self._free)

    @property
    def num_used(self) -> int:
        """Pages with refcount >= 1."""
        return self._num_used

    @property
    def num_cached(self) -> int:
        """Pages with refcount 0 held by the evictor."""
        return self.capacity - self._num_used - len(self._free)

    @property
    def num_available(self) -> int:
        """Pages ``allocate`` can hand out now: free plus evictable."""
        evictable = self._evictor.num_evictable if self._evictor is not None else 0
        return len(self._free) + evictable

    def refcount(self, page: int) -> int:
        self._check_page(page)
        return self._refcount[page]

    def is_free(self, page: int) -> bool:
        self._check_page(page)
        return self._is_free[page]

    # ------------------------------------------------------------------ operations
    def allocate(self, count: int) -> list[int]:
        """``count`` pages with refcount 1, or ``OutOfPagesError`` (nothing changes then)."""
        if count < 0:
            raise ValueError(f"allocate: count must be >= 0, got {count}")
        if count == 0:
            return []
        shortfall = count - len(self._free)
        if shortfall > 0:
            available = self.num_available
            if available < count:
                raise OutOfPagesError(count, available)
            assert self._evictor is not None
            for page in self._evictor.evict(shortfall):
                if self._refcount[page] != 0 or self._is_free[page]:
                    raise AssertionError(f"evictor gave back page {page} that is in use or already free")
                self._push_free(page)
            if len(self._free) < count:
                raise AssertionError("evictor gave back fewer pages than it reported evictable")
        pages = [self._free.pop() for _ in range(count)]
        for page in pages:
            self._is_free[page] = False
            self._refcount[page] = 1
        self._num_used += count
        return pages

    def retain(self, page: int) -> None:
        """One more reference to a used or cached page (a request that shares it)."""
        self._check_page(page)
        if self._is_free[page]:
            raise ValueError(f"retain: page {page} is free")
        if self._refcount[page] == 0:
            if self._evictor is None:
                raise AssertionError(f"page {page} has refcount 0, is not free and there is no evictor")
            self._evictor.on_referenced(page)
            self._num_used += 1
        self._refcount[page] += 1

    def release(self, page: int) -> None:
        """Drop one reference; at 0 the page goes to the evictor (if it keeps it) or the free list."""
        self._check_page(page)
        if self._refcount[page] <= 0:
            raise ValueError(f"release: page {page} has no reference")
        self._refcount[page] -= 1
        if self._refcount[page] == 0:
            self._num_used -= 1
            if self._evictor is None or not self._evictor.on_unreferenced(page):
                self._push_free(page)

    def release_all(self, pages: Iterable[int]) -> None:
        for page in pages:
            self.release(page)

    def free_cached(self, pages: Iterable[int]) -> None:
        """The evictor drops cached pages (refcount 0) outside ``allocate`` (e.g. ``PrefixCache.clear``)."""
        for page in pages:
            if self._refcount[page] != 0 or self._is_free[page]:
                raise ValueError(f"free_cached: page {page} is in use or already free")
            self._push_free(page)

    def check(self) -> None:
        """Assert the allocator's invariants (tests)."""
        free = set(self._free)
        assert len(free) == len(self._free), "a page is twice on the free list"
        assert 0 not in free, "page 0 is on the free list"
        for page in range(1, self.num_pages):
            assert (page in free) == self._is_free[page]
            assert self._refcount[page] >= 0
            if self._is_free[page]:
                assert self._refcount[page] == 0
        used = sum(1 for page in range(1, self.num_pages) if self._refcount[page] > 0)
        assert used == self._num_used, (used, self._num_used)
        if self._evictor is not None:
            assert self.num_cached == self._evictor.num_evictable, (self.num_cached, self._evictor.num_evictable)
        else:
            assert self.num_cached == 0

    # ------------------------------------------------------------------ internals
    def _push_free(self, page: int) -> None:
        self._is_free[page] = True
        self._free.append(page)

    def _check_page(self, page: int) -> None:
        if not 1 <= page < self.num_pages:
            raise ValueError(f"page {page} is outside 1..{self.num_pages - 1} (page 0 is padding)")
