"""Invariant 6: the transient buffers a step touches are exactly the plan's, and the
plan's pool is the peak of their aliased layout."""

from __future__ import annotations

import pytest

from planner.layout import BufferRequest, pack_by_lifetime
from tests.executor.harness import reference_run


@pytest.mark.parametrize("name", ["tiny-qwen3.5-g6", "tiny-qwen3"])
def test_every_touched_transient_buffer_is_planned_and_the_pool_is_their_peak(name):
    # The roles StepViews handed out during the shared teacher-forced run of ``name`` (recorded by
    # harness.reference_run): one batched prefill step, then decode steps.
    run = reference_run(name)
    for pool_name, roles in run.touched.items():
        pool = run.loaded.plan.pool(pool_name)
        planned = {b.name for b in pool.buffers}
        assert roles == planned, f"{pool_name}: touched-only {roles - planned}, planned-only {planned - roles}"
        repacked = pack_by_lifetime(pool_name, [BufferRequest(b.name, b.dtype, b.shape, b.live) for b in pool.buffers
                                                if b.name in roles])
        assert repacked.bytes == pool.bytes
        assert repacked.bytes < sum(b.bytes for b in pool.buffers)  # roles really share bytes
