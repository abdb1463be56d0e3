"""``PageTables``: the running requests' page tables on the host as int32 arrays, grown in place.

A step's ``page_indices`` concatenates the page tables of its requests. Built from the scheduler's
Python lists, that is one int conversion per page per step. At 64 requests of 4,096 tokens
(16,448 pages), ``np.fromiter`` over them took about 0.4 ms of the step's host time on the
development machine, where the whole ``plan_step`` took 0.7 ms. A request's page list only grows
between its admission and its release (scheduler.py: pages are appended as it is fed, and
replaced only by a new admission), so a table kept per admission converts each page once: a
step then converts the few pages appended since the last one and concatenates arrays.

The caller names each table with a key that changes whenever the list may have been replaced:
the engine uses the scheduler's ``Request.admission`` stamp, unique to each admission (a
preempted request is readmitted with a new page list and a new stamp). Tables a step did not use
are dropped by that step's ``end_step``.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence

import numpy as np


class PageTables:
    """Append-only host page tables by key (module docstring). Host memory only; grows by doubling."""

    def __init__(self) -> None:
        self._tables: dict[Hashable, tuple[np.ndarray, int]] = {}  # key -> (int32 storage, pages filled)
        self._used: set[Hashable] = set()

    def __len__(self) -> int:
        return len(self._tables)

    def table(self, key: Hashable, page_ids: Sequence[int], count: int) -> np.ndarray:
        """The first ``count`` pages of ``page_ids`` as an int32 array (a view: valid until the next
        call for ``key``). ``page_ids`` must extend what this key held before; checked cheaply (the
        last page held must be unchanged), since a wrong key is a caller bug, not bad input."""
        entry = self._tables.get(key)
        storage, filled = entry if entry is not None else (np.empty(0, np.int32), 0)
        total = len(page_ids)
        assert filled <= total and (filled == 0 or page_ids[filled - 1] == storage[filled - 1]), (
            f"page table {key!r} shrank or changed: the key must change when the list is replaced")
        if total > storage.shape[0]:
            grown = np.empty(max(total, 2 * storage.shape[0]), np.int32)
            grown[:filled] = storage[:filled]
            storage = grown
        storage[filled:total] = page_ids[filled:total]
        self._tables[key] = (storage, total)
        self._used.add(key)
        return storage[:count]

    def end_step(self) -> None:
        """Drop the tables the step just planned did not use (finished or preempted requests)."""
        for key in self._tables.keys() - self._used:
            del self._tables[key]
        self._used.clear()
