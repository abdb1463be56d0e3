"""The prefix cache's recurrent-state snapshot table: slots after the requests' ones, the longest covered prefix,
least recently used out first."""

from __future__ import annotations

import pytest

from executor.state_snapshots import StateSnapshots


def test_slots_follow_the_requests_slots_and_the_least_recently_used_is_overwritten():
    table = StateSnapshots(first_slot=8, count=2)
    assert table.take(101) == 8 and table.take(102) == 9
    assert table.take(101) is None  # already held: nothing to copy
    assert table.use(101) == 8  # 101 is now the most recently used
    assert table.take(103) == 9  # so 102's slot is the one overwritten
    assert table.longest([102]) == 0 and table.longest([101, 102, 103]) == 3
    assert (table.taken, table.restores, len(table)) == (3, 1, 2)
    table.check()


def test_longest_is_the_last_entry_with_a_snapshot_and_leaves_the_order_alone():
    table = StateSnapshots(first_slot=0, count=2)
    table.take(1)
    table.take(3)
    assert table.longest([1, 2]) == 1 and table.longest([1, 2, 3, 4]) == 3 and table.longest([5]) == 0
    assert table.take(5) == 0  # 1 is still the least recently used: longest() did not touch it
    table.check()


def test_a_table_without_a_slot_is_refused():
    with pytest.raises(ValueError, match="count >= 1"):
        StateSnapshots(first_slot=4, count=0)
