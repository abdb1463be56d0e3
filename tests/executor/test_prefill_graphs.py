"""Prefill graphs (executor/models/graphs.py, PrefillGraphs): a prefill step and a mixed step replay
their row bucket's pieces between eager attention. On the GPU, replaying the captured pieces gives
exactly the logits of the same pieces launched eagerly at the bucket's rows, allocates nothing and
moves no pointer; the planner lists the buckets the step's rows allow."""

from __future__ import annotations

import pytest
import torch

from executor.kernels.rope import fused_kv_write
from executor.models.context import prefill_bucket_views
from executor.step import RequestChunk, plan_step
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan
from tests.executor.harness import Loaded, decode_state, load_tiny, load_with_hf, random_sequences


class EagerPieces:
    """PrefillGraphs' interface, replaying nothing: each piece launches eagerly at its bucket's rows (what
    the captured piece records)."""

    def __init__(self, loaded: Loaded, buckets: tuple[int, ...]):
        self.loaded, self.buckets = loaded, buckets
        self.replays = 0

    def bucket_for(self, num_rows: int) -> int | None:
        return next((b for b in self.buckets if b >= num_rows), None)

    def replay(self, bucket: int, index: int) -> None:
        self.replays += 1
        self.loaded.model._piece(index, prefill_bucket_views(self.loaded.arena, bucket))


def _two_steps(loaded: Loaded, lengths: list[int]) -> tuple[list[torch.Tensor], list[list[int]]]:
    """A prefill step of three prompts, then a mixed step of their three decode rows and a fourth prompt,
    from fresh slots; the logits and tokens of each."""
    plan, model = loaded.plan, loaded.model
    pages_each = plan.capacity.pages_per_request
    prompts = random_sequences(plan.model.vocab_size, lengths, seed=3)
    pages = [list(range(1 + r * pages_each, 1 + (r + 1) * pages_each)) for r in range(len(prompts))]
    for slot in range(len(prompts)):
        model.reset_slot(slot)
    first = [RequestChunk(p, 0, pages[r], slot=r) for r, p in enumerate(prompts[:3])]
    tokens = [model.step(plan_step(plan, first)).tolist()]
    logits = [model.logits(3).clone()]
    second = [RequestChunk([t], len(p), pages[r], slot=r) for r, (p, t) in enumerate(zip(prompts, tokens[0]))]
    second.append(RequestChunk(prompts[3], 0, pages[3], slot=3))
    tokens.append(model.step(plan_step(plan, second)).tolist())
    logits.append(model.logits(4).clone())
    return logits, tokens


def test_plan_keeps_the_buckets_a_step_holds():
    plan = build_plan(load_model("qwen3-0.6b"), load_hardware("h200"),
                      load_serving("default", {"max_batch": 8, "max_prefill_tokens": 512}))
    assert plan.capacity.max_tokens_per_step == 519
    assert plan.capacity.prefill_graph_rows[-3:] == (384, 448, 512)
    line = next(b for pool in plan.pools if pool.name == "runtime" for b in pool.buffers if b.name == "prefill_graphs")
    assert line.bytes == len(plan.capacity.prefill_graph_rows) * 29 * plan.hardware.cuda_graph_piece_bytes > 0


#: (model, fused q/k norm + RoPE + KV write row limit): each model takes one of the two RoPE paths (they
#: share the attention layer's code; a simulator run of this test takes half a minute).
ROPE_PATHS = [("tiny-qwen3", None), ("tiny-qwen3.5", 8)]


@pytest.mark.parametrize(("name", "fused_rows"), ROPE_PATHS, ids=["tiny-qwen3-rope-eager", "tiny-qwen3.5-rope-in-piece"])
def test_pieces_at_a_padded_bucket_leave_the_step_unchanged(name, fused_rows, monkeypatch):
    """The pieces run over padded rows (whatever those rows hold) without changing the step's rows, the
    KV cache or the recurrent state: the simulator's float32 forward, unpadded against padded. With the
    fused q/k norm + RoPE + KV write limited to 8 rows, both steps norm and rotate q and k in their input
    pieces and write the KV cache eagerly."""
    if fused_rows is not None:
        monkeypatch.setattr(fused_kv_write, "FUSED_ROPE_KV_MAX_ROWS", fused_rows)
    loaded = load_tiny(name)
    lengths = [3, 4, 5, 6]  # 12 rows, then 3 decode rows and 6: 9 (the plan's steps hold 19)
    plain_logits, plain_tokens = _two_steps(loaded, lengths)
    plain_state = decode_state(loaded)
    pieces = loaded.model.prefill_graphs = EagerPieces(loaded, (10, 19))  # 12 rows -> 19, then 9 -> 10
    padded_logits, padded_tokens = _two_steps(loaded, lengths)
    assert pieces.replays == 2 * (loaded.plan.geometry.num_layers + 1)
    assert padded_tokens == plain_tokens
    for padded, plain in zip(padded_logits, plain_logits):
        assert torch.allclose(padded, plain, rtol=1e-5, atol=1e-6)
    for key, value in decode_state(loaded).items():
        assert torch.allclose(value, plain_state[key], rtol=1e-5, atol=1e-6, equal_nan=True), key


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-0.8b"])
def test_piece_replay_equals_eager_pieces_at_the_bucket(name):
    loaded = load_with_hf(name, "h200", "default", max_batch=8, max_context=1024, max_prefill_tokens=512,
                          gpu_memory_utilization=0.25)
    model = loaded.model
    assert 384 in loaded.plan.capacity.prefill_graph_rows and 128 in loaded.plan.capacity.prefill_graph_rows
    model.capture_prefill_graphs()
    assert model.prefill_graphs.bucket_for(371) == 384 and model.prefill_graphs.bucket_for(103) == 128
    pointers = {key: view.data_ptr() for key, view in loaded.arena._views.items()}
    allocations = torch.cuda.memory_stats()["allocation.all.allocated"]
    lengths = [7, 300, 64, 100]  # 371 rows, then 3 decode rows and 100: 103
    graph_logits, graph_tokens = _two_steps(loaded, lengths)
    clones = 4  # the logits and token lists _two_steps keeps
    assert torch.cuda.memory_stats()["allocation.all.allocated"] - allocations <= clones
    assert {key: view.data_ptr() for key, view in loaded.arena._views.items()} == pointers

    model.prefill_graphs = EagerPieces(loaded, model.prefill_graphs.buckets)
    eager_logits, eager_tokens = _two_steps(loaded, lengths)
    assert graph_tokens == eager_tokens
    for graph, eager in zip(graph_logits, eager_logits):
        assert torch.equal(graph, eager)

    # Unpadded eager GEMMs run other row counts, so cuBLAS may round otherwise in bf16: a near match.
    model.prefill_graphs = None
    plain_logits, plain_tokens = _two_steps(loaded, lengths)
    difference = max(float((p - g).abs().max()) for p, g in zip(plain_logits, graph_logits))
    scale = max(float(g.abs().max()) for g in graph_logits)
    print(f"{name}: pieces replayed == eager pieces at buckets 384 and 128; vs unpadded eager: tokens "
          f"{plain_tokens} vs {graph_tokens}, max |logit difference| {difference:.4f} of {scale:.1f}")
    assert difference <= 0.05 * scale
