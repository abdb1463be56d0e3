"""The prefix cache's recurrent-state snapshots (Qwen3.5), pure Python.

A model with linear-attention layers resumes a request from a cached KV prefix only with the
recurrent state (every linear layer's conv and delta-rule state) at that prefix's end. The plan
holds ``capacity.prefix_state_slots`` snapshot slots in the recurrent-state pool, after the
requests' ``capacity.recurrent_slots``; this table says which cached prefix each one holds.

A snapshot is named by the prefix cache entry of its prefix's last page (``PrefixCache.entry_uid``):
an entry's uid is never reused and an entry names its parent by uid, so a uid stands for one chain
of pages and their exact token ids. A lookup that matched k pages resumes from the longest of its
first k entries that has a snapshot.

The scheduler takes a snapshot where an admitted request's prompt leaves the cached prefix: there,
two prompts share their pages and then part, so a third that shares them resumes from it. The state
is copied into the snapshot slot after the step whose chunk ends there, and out of it into a
request's slot before the request's first step. Both copies run on the step stream in step order, so
a snapshot is written before any later step reads it, and a restore queued before a step reads its
slot before a snapshot taken after that step overwrites it: a slot needs no reference count. The
least recently used snapshot is the one overwritten.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence


class StateSnapshots:
    """Snapshot slots ``first_slot .. first_slot + count - 1`` by the prefix-cache entry uid they hold."""

    def __init__(self, first_slot: int, count: int):
        if first_slot < 0 or count < 1:
            raise ValueError(f"state snapshots: need first_slot >= 0 and count >= 1, got {first_slot}, {count}")
        self.first_slot, self.count = first_slot, count
        self._slots: OrderedDict[int, int] = OrderedDict()  # entry uid -> slot, least recently used first
        self._free = list(range(first_slot + count - 1, first_slot - 1, -1))  # popped lowest first
        self.taken = 0
        self.restores = 0

    def __len__(self) -> int:
        return len(self._slots)

    def longest(self, uids: Sequence[int]) -> int:
        """The largest k whose prefix ``uids[:k]`` ends in an entry with a snapshot, 0 for none. Pure: the
        recency order is left alone."""
        return next((k for k in range(len(uids), 0, -1) if uids[k - 1] in self._slots), 0)

    def use(self, uid: int) -> int:
        """The slot of ``uid``'s snapshot, now the most recently used (a request restores from it)."""
        self._slots.move_to_end(uid)
        self.restores += 1
        return self._slots[uid]

    def take(self, uid: int) -> int | None:
        """The slot to copy ``uid``'s state into (a free one, else the least recently used one's);
        None when ``uid`` already has a snapshot."""
        if uid in self._slots:
            return None
        slot = self._free.pop() if self._free else self._slots.popitem(last=False)[1]
        self._slots[uid] = slot
        self.taken += 1
        return slot

    def check(self) -> None:
        """Assert the table's invariants (tests): every slot is free or holds exactly one uid."""
        held = sorted(self._slots.values()) + self._free
        assert sorted(held) == list(range(self.first_slot, self.first_slot + self.count))
