"""Split-KV decode: a decode row's attention cut into kv chunks on separate blocks and merged
gives the same logits as the same row attended by one block."""

from __future__ import annotations

import torch

from executor.models.context import StepViews
from executor.step import RequestChunk, plan_step
from tests.executor.harness import load_tiny


def test_split_decode_equals_one_chunk_and_touches_exactly_the_planned_decode_buffers(monkeypatch):
    touched: set[str] = set()
    original = StepViews.role

    def recording(self, role):
        touched.add(role)
        return original(self, role)

    monkeypatch.setattr(StepViews, "role", recording)
    loaded = load_tiny("tiny-qwen3", max_context=192)
    plan = loaded.plan
    assert plan.capacity.decode_kv_splits == 3
    # The host splits to reach about two blocks per SM: cpu-sim has one SM (no split);
    # the same plan on a 132-SM device splits 141 keys into chunks of 64.
    many_sms = plan.model_copy(update={"hardware": plan.hardware.model_copy(update={"num_sms": 132})})
    kv = loaded.arena.tensor("kv_cache", "kv_cache")
    kv.copy_(torch.randn(kv.shape, generator=torch.Generator().manual_seed(0)))
    chunks = [RequestChunk([5], 140, list(range(1, 37))), RequestChunk([7], 20, list(range(37, 73)))]
    logits = {}
    for label, planned in (("one chunk", plan), ("split", many_sms)):
        meta = plan_step(planned, chunks)
        logits[label] = (meta.kv_tile_indices.tolist(), loaded.model.step(meta).tolist(),
                         loaded.model.logits(2).clone())
    assert logits["one chunk"][0] == [0, 0]
    assert logits["split"][0] == [0, 1, 2, 0]  # 141 keys in chunks of 64; 21 keys in one
    assert logits["split"][1] == logits["one chunk"][1]
    difference = float((logits["split"][2] - logits["one chunk"][2]).abs().max())
    assert difference <= 1e-5 * float(logits["one chunk"][2].abs().max())
    # Invariant 6 with the split scratch planned: the decode step used exactly the decode pool.
    assert touched == {b.name for b in plan.pool("decode").buffers}
