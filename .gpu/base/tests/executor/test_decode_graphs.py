"""Decode CUDA graphs: a step padded to its bucket (what a graph records) gives the real rows
exactly the unpadded step's results and touches no real state; on the GPU, replaying the
captured graphs gives exactly the eager padded step's logits and tokens."""

from __future__ import annotations

import pytest
import torch

from executor.step import plan_step
from tests.executor.harness import (
    decode_state, greedy_decode, load_tiny, load_with_hf, prefilled_requests, restore_decode_state,
)


@pytest.mark.parametrize("name", ["tiny-qwen3", "tiny-qwen3.5"])
def test_padded_decode_equals_unpadded_and_leaves_other_state_alone(name):
    loaded = load_tiny(name)
    chunks = prefilled_requests(loaded, [3, 5], seed=1)
    before = decode_state(loaded)
    logits, tokens = greedy_decode(loaded, chunks, steps=1)
    after_unpadded = decode_state(loaded)
    restore_decode_state(loaded, before)
    bucket = loaded.plan.capacity.max_batch
    padded_logits, padded_tokens = greedy_decode(loaded, chunks, steps=1, pad_to=bucket)
    assert bucket > len(chunks)
    assert padded_tokens == tokens
    assert float((padded_logits - logits).abs().max()) <= 1e-6 * float(logits.abs().max())
    after_padded = decode_state(loaded)
    # Padding rows write only page 0 (the padding page) and no recurrent slot.
    kv = "kv_cache"
    for name in after_padded:
        real = slice(1, None) if name == kv else slice(None)
        # equal_nan: untouched pages keep their NaN poison in both runs. The GEMMs ran over 2
        # vs 4 rows, so values may differ in the last bits.
        assert torch.allclose(after_padded[name][real], after_unpadded[name][real], rtol=1e-5, atol=1e-6,
                              equal_nan=True), name


@pytest.mark.gpu
@pytest.mark.parametrize("prompts, bucket", [([7, 300, 64], 4), ([300], 1)], ids=["bucket-4", "bucket-1-gemv"])
@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-0.8b"])
def test_graph_replay_equals_eager_padded_step(name, prompts, bucket):
    """Three requests replay the bucket-4 graph (cuBLAS projections); one request the bucket-1 graph
    (the fused GEMV projections, capacity decode_gemv_batch)."""
    loaded = load_with_hf(name, "h200", "default", max_batch=8, max_context=1024, max_prefill_tokens=512,
                          gpu_memory_utilization=0.25)
    assert loaded.plan.capacity.decode_gemv_batch == 1
    chunks = prefilled_requests(loaded, prompts, seed=2)
    before = decode_state(loaded)
    eager_logits, eager_tokens = greedy_decode(loaded, chunks, steps=16, pad_to=bucket)
    restore_decode_state(loaded, before)
    loaded.model.capture_decode_graphs()
    pointers = {key: view.data_ptr() for key, view in loaded.arena._views.items()}
    graph_logits, graph_tokens = greedy_decode(loaded, chunks, steps=16)
    assert loaded.model.graphs.bucket_for(len(chunks)) == bucket
    # Replays allocate nothing (the clones above are the test's own).
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    for _ in range(8):
        loaded.model.step(plan_step(loaded.plan, chunks)).tolist()
    assert torch.cuda.memory_stats()["allocation.all.allocated"] == allocations
    assert {key: view.data_ptr() for key, view in loaded.arena._views.items()} == pointers
    assert graph_tokens == eager_tokens
    assert torch.equal(graph_logits, eager_logits)
    # Eager without padding runs GEMMs of 3 rows instead of 4; in bf16 cuBLAS may pick another
    # kernel, so compare it as a near match, not bit for bit.
    loaded.model.graphs = None
    restore_decode_state(loaded, before)
    plain_logits, plain_tokens = greedy_decode(loaded, chunks, steps=16)
    matching = sum(a == b for a, b in zip(plain_tokens, graph_tokens))
    difference = float((plain_logits - graph_logits).abs().max())
    print(f"{name}: graph == eager padded over 16 steps x {len(chunks)} requests; vs unpadded eager: "
          f"{matching}/16 steps with identical tokens, max |logit difference| {difference:.4f}")
