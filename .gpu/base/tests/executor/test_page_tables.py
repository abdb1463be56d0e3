"""PageTables: a step planned from kept page tables has the same metadata as one planned from the
scheduler's lists, through growth, readmission (a new key) and requests leaving."""

from __future__ import annotations

import numpy as np
import pytest

from executor.page_tables import PageTables
from executor.scheduler import Request, Scheduler
from executor.step import RequestChunk, plan_step
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan


@pytest.fixture(scope="module")
def plan():
    return build_plan(load_model("tiny-qwen3"), load_hardware("cpu-sim"), load_serving("sim"))


def _chunks(step, requests, keyed: bool) -> list[RequestChunk]:
    return [RequestChunk(c.token_ids, c.num_cached, c.page_ids, c.slot,
                         page_table_key=requests[c.request_id].admission if keyed else None) for c in step.chunks]


def test_kept_tables_plan_the_same_steps_as_the_lists(plan):
    """A scheduler run with chunked prefill, decode growth across pages and preemption under page
    pressure (tight KV pool): every step's metadata equal with and without the kept tables."""
    capacity = plan.capacity.model_copy(update={"kv_pages": 24})  # 23 usable pages of 4 tokens: preemptions
    scheduler = Scheduler(capacity, prefix_caching=False, has_recurrent_state=False)
    requests = {i: Request(i, list(range(1, 14 + 3 * i)), 12) for i in range(4)}
    for request in requests.values():
        scheduler.add(request)
    tables, steps, admissions = PageTables(), 0, set()
    while (step := scheduler.schedule()) is not None:
        expected = plan_step(plan, _chunks(step, requests, keyed=False))
        got = plan_step(plan, _chunks(step, requests, keyed=True), tables)
        for field in ("page_indices", "page_indptr", "positions", "last_page_len", "token_ids"):
            np.testing.assert_array_equal(getattr(got, field), getattr(expected, field), err_msg=f"step {steps} {field}")
        assert len(tables) == len(step.chunks)  # tables of requests not in the step were dropped
        admissions |= {requests[c.request_id].admission for c in step.chunks}
        scheduler.update(step, [5] * len(step.chunks))
        steps += 1
    assert scheduler.stats().preemptions > 0, "the run is meant to readmit requests under new keys"
    assert len(admissions) > len(requests)


def test_a_shrunk_or_replaced_list_under_the_same_key_is_an_internal_error():
    """The cheap check: the page a key's table ends with must still be there, at the same index."""
    tables = PageTables()
    assert tables.table("r", [3, 4, 5], 2).tolist() == [3, 4]
    assert tables.table("r", [3, 4, 5, 9], 4).tolist() == [3, 4, 5, 9]  # grown: only page 9 converted
    for replaced in ([3, 4, 5], [8, 2, 6, 7, 1]):
        with pytest.raises(AssertionError, match="shrank or changed"):
            tables.table("r", replaced, 3)
