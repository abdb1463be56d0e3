"""Step metadata: filled in place, and every capacity error named before anything is written."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.arena import materialize
from executor.device import open_device
from executor.routing import FEW_BLOCKS_PER_SM
from executor.tiles import plan_decode_tiles
from executor.step import CapacityError, RequestChunk, decode_kv_chunk, decode_grid_tiles, pad_decode, plan_step
from executor.step_writer import StepWriter
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan


@pytest.fixture(scope="module")
def arena():
    plan = build_plan(load_model("tiny-qwen3.5-g6"), load_hardware("cpu-sim"), load_serving("sim"))
    return materialize(plan, open_device("auto"))


def _snapshot(arena):
    return {name: raw.clone() for name, raw in arena.pools.items() if name != "kv_cache"}


def test_metadata_of_a_mixed_step(arena):
    """A 5-token prefill chunk after 3 cached tokens beside a decode row; pages shared by both."""
    page = arena.plan.capacity.page_size  # 4
    chunks = [RequestChunk([7], 6, [3, 9], slot=0), RequestChunk([1, 2, 3, 4, 5], 3, [3, 4], slot=1)]
    meta = plan_step(arena.plan, chunks)
    StepWriter(arena).write(meta)
    view = lambda name: arena.tensor("attention_plan", name)  # noqa: E731
    assert meta.pool == "prefill" and meta.num_rows == 6
    assert view("q_indptr")[:3].tolist() == [0, 1, 6]
    assert view("positions")[:6].tolist() == [6, 3, 4, 5, 6, 7]
    assert view("batch_indices")[:6].tolist() == [0, 1, 1, 1, 1, 1]
    assert view("page_indptr")[:3].tolist() == [0, 2, 4]
    assert view("page_indices")[:4].tolist() == [3, 9, 3, 4]  # page 3 listed by both requests
    assert view("last_page_len")[:2].tolist() == [7 - page, 8 - page]
    assert int(view("total_num_rows")[0]) == 6
    assert arena.tensor("sampling", "logits_indices")[:2].tolist() == [0, 5]
    assert arena.tensor("recurrent_state", "slot_ids")[:2].tolist() == [0, 1]


def test_a_prefill_step_puts_its_decode_rows_tiles_last_for_the_decode_kernel(arena):
    """Decode rows around a 3-token chunk (short of gemm_attention_min_tokens = 4: the paged kernel's) and
    a 5-token one (the long-chunk backend's, no tile): the short chunk's tiles come first, then one
    whole-row tile per decode row (request, query tile 0, kv chunk 0, kv_chunk_size its kv_len)."""
    assert arena.plan.serving.gemm_attention_min_tokens == 4
    chunks = [RequestChunk([7], 6, [3, 9], slot=0), RequestChunk([1, 2, 3], 2, [4, 5], slot=1),
              RequestChunk([8], 4, [6, 7], slot=2), RequestChunk([1, 2, 3, 4, 5], 0, [8, 10], slot=3)]
    meta = plan_step(arena.plan, chunks)
    assert meta.pool == "prefill" and meta.num_decode_row_tiles == 2
    assert meta.leading_decode_rows == 1  # the decode delta rule's: requests (and rows) before the first chunk
    assert plan_step(arena.plan, [chunks[0], chunks[2], *chunks[1:2]]).leading_decode_rows == 2
    assert [r.request for r in meta.long_prefill_requests] == [3]
    assert meta.request_indices.tolist() == [1] * (meta.num_tiles - 2) + [0, 2]
    assert meta.qo_tile_indices[-2:].tolist() == meta.kv_tile_indices[-2:].tolist() == [0, 0]
    assert meta.kv_chunk_size[[0, 2]].tolist() == [7, 5]
    assert plan_step(arena.plan, chunks[1:2]).num_decode_row_tiles == 0
    assert plan_step(arena.plan, [chunks[0], chunks[2]]).num_decode_row_tiles == 0  # a decode step's tiles


def test_writer_changes_only_the_metadata_buffers(arena):
    """Writes go over in merged ranges that may span a buffer's unused tail, never another buffer: after
    the kernels' buffers change under it, a write leaves them alone, and a shorter step after a longer
    one still lands in every buffer's leading elements."""
    writer = StepWriter(arena)
    logits, last_hidden = arena.tensor("sampling", "logits"), arena.tensor("sampling", "last_hidden")
    logits.fill_(1.5)  # the sampling pool: kernel buffers between the metadata buffers
    last_hidden.fill_(2.5)
    gate_up = arena.tensor("decode", "gate_up")  # shares bytes with decode/token_ids (other live ranges)
    gate_up.view(-1)[-1:] = 3.5
    long = plan_step(arena.plan, [RequestChunk([1, 2, 3], 6, [3, 9, 4], slot=0), RequestChunk([5], 2, [7], slot=1)])
    short = plan_step(arena.plan, [RequestChunk([8], 8, [2, 6, 5], slot=2)])
    writer.write(long)
    writer.write(short)
    assert bool((logits == 1.5).all()) and bool((last_hidden == 2.5).all()) and float(gate_up.view(-1)[-1]) == 3.5
    for field in ("page_indices", "page_indptr", "positions", "q_indptr", "request_indices", "kv_chunk_size"):
        values = getattr(short, field)
        assert arena.tensor("attention_plan", field)[: len(values)].tolist() == values.tolist(), field
    assert arena.tensor("decode", "token_ids")[:1].tolist() == [8]
    assert arena.tensor("sampling", "logits_indices")[:1].tolist() == [0]
    assert arena.tensor("sampling", "sample_steps")[:1].tolist() == short.sample_steps.tolist()
    assert arena.tensor("recurrent_state", "slot_ids")[:1].tolist() == [2]


def test_long_prefill_chunks_route_to_gemm_attention_in_tiles_that_fit_the_scores(arena):
    """sim serving: chunks of >= 4 tokens take GEMM attention and no paged-attention tile; with
    scores for 2 rows of a 9-token context, the 5-row chunk runs in tiles of 2 rows."""
    plan = arena.plan
    assert plan.serving.gemm_attention_min_tokens == 4
    chunks = [RequestChunk([7], 6, [3, 9], slot=0), RequestChunk([1, 2, 3], 0, [5], slot=1),
              RequestChunk([1, 2, 3, 4, 5], 4, [3, 4, 6], slot=2)]
    meta = plan_step(plan, chunks)
    (routed,) = meta.long_prefill_requests
    assert (routed.request, routed.q_start, routed.num_rows, routed.kv_len, routed.page_start) == (2, 4, 5, 9, 3)
    assert set(meta.request_indices.tolist()) == {0, 1}  # the paged kernel has the other two
    heads = plan.geometry.num_q_heads
    assert routed.rows_per_tile == 5 and heads * 5 * 9 <= plan.capacity.prefill_score_elements
    tight = plan.model_copy(update={"capacity": plan.capacity.model_copy(
        update={"prefill_score_elements": heads * 9 * 2 + heads * 9 - 1})})  # 2 rows fit, 3 do not
    assert plan_step(tight, chunks).long_prefill_requests[0].rows_per_tile == 2


def test_a_full_batch_at_full_context_uses_every_logical_page(arena):
    cap = arena.plan.capacity
    shared = list(range(1, cap.pages_per_request))  # a shared prefix of every request
    chunks = [RequestChunk([5], cap.max_context - 1, shared + [100 + r], slot=r) for r in range(cap.max_batch)]
    meta = plan_step(arena.plan, chunks)
    assert meta.page_indices.shape[0] == cap.logical_pages
    assert len(set(meta.page_indices.tolist())) < cap.logical_pages


@pytest.mark.parametrize("model,hardware", [("qwen3-8b", "h200"), ("qwen3.5-9b", "h200"),
                                            ("qwen3-0.6b", "a100-80gb"), ("qwen3-14b", "l40s")])
def test_a_decode_graph_grid_holds_every_step_of_its_bucket_with_less_than_a_wave_of_padding(model, hardware):
    plan = build_plan(load_model(model), load_hardware(hardware), load_serving("default"))
    cap, num_kv_heads = plan.capacity, plan.geometry.num_kv_heads
    wave = FEW_BLOCKS_PER_SM * plan.hardware.num_sms  # blocks a decode step aims to run at once
    most = 0  # the most tiles a step of at most `bucket` requests makes, all rows long or one long
    for bucket in range(1, cap.max_batch + 1):
        for kv_lens in (np.full(bucket, cap.max_context), np.r_[cap.max_context, np.ones(bucket - 1, np.int64)]):
            tiles = plan_decode_tiles(kv_lens, decode_kv_chunk(plan, kv_lens), cap.decode_kv_splits)
            most = max(most, len(tiles[0]))
        assert most <= decode_grid_tiles(plan, bucket) <= cap.tiles
        assert (decode_grid_tiles(plan, bucket) - most) * num_kv_heads < wave, bucket


def test_a_padded_decode_step_pads_its_tiles_to_the_graph_grid(arena):
    plan = arena.plan.model_copy(update={"hardware": arena.plan.hardware.model_copy(update={"num_sms": 132})})
    meta = plan_step(plan, [RequestChunk([5], 59, list(range(1, 16)), slot=0)])
    padded = pad_decode(plan, meta, 2)
    num_tiles = decode_grid_tiles(plan, 2)
    assert meta.num_tiles < num_tiles == len(padded.request_indices)
    assert padded.request_indices[:meta.num_tiles].tolist() == meta.request_indices.tolist()
    assert (padded.request_indices[meta.num_tiles:] == -1).all()


def _over(arena, dimension):
    cap = arena.plan.capacity
    if dimension == "batch":
        return [RequestChunk([1], 0, [1], slot=r) for r in range(cap.max_batch + 1)]
    if dimension == "total_tokens":
        return [RequestChunk(list(range(cap.max_tokens_per_step + 1)), 0, list(range(1, 40)), slot=0)]
    if dimension == "context":
        return [RequestChunk([1], cap.max_context, list(range(1, cap.pages_per_request + 2)), slot=0)]
    if dimension == "kv_pages":
        return [RequestChunk([1], 0, [cap.kv_pages], slot=0)]
    if dimension == "recurrent_slots":
        return [RequestChunk([1], 0, [1], slot=cap.recurrent_slots)]
    raise AssertionError(dimension)


@pytest.mark.parametrize("dimension", ["batch", "total_tokens", "context", "kv_pages", "recurrent_slots"])
def test_capacity_errors_name_the_dimension_and_leave_the_arena_untouched(arena, dimension):
    before = _snapshot(arena)
    with pytest.raises(CapacityError) as error:
        meta = plan_step(arena.plan, _over(arena, dimension))
        StepWriter(arena).write(meta)
    assert error.value.dimension == dimension
    assert error.value.required > error.value.capacity
    assert f"{dimension}: step needs" in str(error.value)
    after = _snapshot(arena)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.gpu
def test_writer_never_refills_a_mirror_the_gpu_has_not_read(arena):
    """CUDA: a step's copies queued behind ~0.1 s of GPU work, then the next step's write. The first
    copies still deliver the first step's arrays (the second write waited for them instead of refilling
    the pinned mirrors under them), and the buffers end with the second step's."""
    assert not arena.device.is_sim
    writer = StepWriter(arena)
    first = plan_step(arena.plan, [RequestChunk([7], 6, [3, 9], slot=0)])
    second = plan_step(arena.plan, [RequestChunk([1], 9, [3, 4, 5], slot=1)])
    positions = arena.tensor("attention_plan", "positions")
    torch.cuda._sleep(200_000_000)  # clock cycles
    writer.write(first)
    delivered = positions[:1].clone()  # ordered after the first step's copies on the same stream
    writer.write(second)
    torch.cuda.synchronize()
    assert delivered.tolist() == first.positions.tolist() == [6]
    assert positions[:1].tolist() == second.positions.tolist() == [9]


@pytest.mark.parametrize("backend, rows_per_tile", [("gemm", (1 << 26) // (32 * 40960)), ("flash", 4096)])
def test_a_long_chunk_runs_in_score_tiles_with_gemm_and_in_one_launch_with_flash(backend, rows_per_tile):
    """Qwen3-8B at C = 40960: a 4096-token chunk ending at 40960 tokens is one long-chunk request either
    way; GEMM attention tiles its rows so that 32 heads x rows x 40960 scores fit the 2^26-element tile,
    FlashAttention keeps no scores and takes all of them in one launch."""
    plan = build_plan(load_model("qwen3-8b"), load_hardware("h200"),
                      load_serving("default", {"max_context": 40960, "max_prefill_tokens": 4096, "max_batch": 8,
                                               "prefill_attention": backend}))
    pages = list(range(1, 1 + plan.capacity.pages_per_request))
    meta = plan_step(plan, [RequestChunk([1] * 4096, 40960 - 4096, pages)])
    (routed,) = meta.long_prefill_requests
    assert (routed.num_rows, routed.kv_len, routed.rows_per_tile) == (4096, 40960, rows_per_tile)
    assert meta.num_tiles == 0  # no paged-attention tile


def test_long_chunks_pack_into_launches_whose_keys_fit_the_gather_scratch():
    """Qwen3-8B flash at C = 8192, chunks of >= 256 rows: a step of a decode row, 1,024 rows after 5,000
    cached tokens, a 100-row chunk (the paged kernel's), 2,048 rows and 1,024 rows after 2,000. Their
    kv_len 6,024 + 2,048 fit the 8,192-key scratch together (one launch over requests 1..3, the short one
    among them skipped); the 3,024 of the last do not, so it takes a second launch."""
    plan = build_plan(load_model("qwen3-8b"), load_hardware("h200"),
                      load_serving("default", {"max_context": 8192, "max_prefill_tokens": 8192, "max_batch": 8,
                                               "prefill_attention": "flash", "gemm_attention_min_tokens": 256}))
    assert plan.capacity.prefill_gather_tokens == 8192
    per_request = plan.capacity.pages_per_request
    chunks = [(1, 300), (1024, 5000), (100, 0), (2048, 0), (1024, 2000)]  # (rows, cached)
    step = [RequestChunk([1] * rows, cached, list(range(1 + i * per_request, 1 + (i + 1) * per_request)))
            for i, (rows, cached) in enumerate(chunks)]
    meta = plan_step(plan, step)
    assert [r.request for r in meta.long_prefill_requests] == [1, 3, 4]
    groups = [(g.first_request, g.num_requests, g.kv_tokens, g.max_rows, g.max_kv_len)
              for g in meta.long_prefill_groups]
    assert groups == [(1, 3, 6024 + 2048, 2048, 6024), (4, 1, 3024, 1024, 3024)]
