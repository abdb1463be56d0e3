"""One step's batch on the host, checked against the plan's capacities.

A step is a list of ``RequestChunk``: each request contributes the tokens it
feeds this step (a prefill chunk, or one decode token) and its page table.
``plan_step`` builds the host arrays and checks every capacity before anything
is written, so a step that does not fit raises ``CapacityError`` and leaves the
arena untouched (invariant 4, docs/design.md). ``step_writer.StepWriter`` then
copies the arrays into the planned buffers' leading rows: no allocation on the
device.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from itertools import chain, islice

import numpy as np

from executor.page_tables import PageTables
from executor.routing import FEW_BLOCKS_PER_SM, PREFILL_ROWS_PER_TILE
from executor.tiles import NO_SPLIT_CHUNK, plan_decode_tiles, plan_tiles
from planner.kernel_limits import MIN_KV_CHUNK_TOKENS
from planner.plan import MemoryPlan


class CapacityError(RuntimeError):
    """A step needs more than a planned capacity. Names the dimension, required and planned value."""

    def __init__(self, dimension: str, required: int, capacity: int, detail: str = ""):
        self.dimension = dimension
        self.required = required
        self.capacity = capacity
        suffix = f" ({detail})" if detail else ""
        super().__init__(f"{dimension}: step needs {required:,}, plan has {capacity:,}{suffix}")


@dataclass(frozen=True)
class RequestChunk:
    """What one request feeds a step.

    token_ids   the new tokens (a prefill chunk, or one decode token), >= 1; an id -(r + 1) stands
                for the id the previous step sampled for its request r, read on the device
                (the overlapped engine's decode rows: kernels/rows/embedding.py)
    num_cached  tokens of the request already in the KV cache / recurrent state
    page_ids    physical KV pages of its logical pages, covering num_cached + len(token_ids)
    slot        recurrent-state slot (Qwen3.5), -1 for none
    temperature, top_k, top_p, seed   sampling parameters (temperature <= 0: greedy; top_p >= 1: no nucleus)
    sample_step index of the token this step samples for the request (the RNG counter)
    page_table_key  names page_ids in plan_step's PageTables (it only grows under one key); None:
                converted from page_ids every step
    """

    token_ids: Sequence[int]
    num_cached: int
    page_ids: Sequence[int]
    slot: int = -1
    temperature: float = 0.0
    top_k: int = 0
    seed: int = 0
    sample_step: int = 0
    top_p: float = 1.0
    page_table_key: Hashable | None = None


@dataclass(frozen=True)
class LongPrefillRequest:
    """A prefill chunk long enough (serving gemm_attention_min_tokens) that its attention runs over its
    keys and values gathered from the KV pages, in the plan's prefill_attention backend
    (executor.models.prefill_attention: GEMMs; executor.models.flash_prefill_attention: FlashAttention)
    rather than the paged kernel.

    request        its index in the step
    q_start        its first row in the step
    num_rows       its rows (new tokens); their positions are kv_len - num_rows .. kv_len - 1
    kv_len         its tokens in the KV cache after this step
    page_start     its first entry in the step's page_indices
    rows_per_tile  query rows per attention pass. gemm: a tile whose Hq x rows_per_tile x kv_len scores
                   fit the plan's prefill_score_elements; flash: num_rows (one launch, no score buffer)
    """

    request: int
    q_start: int
    num_rows: int
    kv_len: int
    page_start: int
    rows_per_tile: int


@dataclass(frozen=True)
class LongPrefillGroup:
    """Long prefill chunks that one packed gather and one FlashAttention launch serve together
    (executor/kernels/attention/packed.py): the step's requests ``first_request .. first_request +
    num_requests - 1``, of which those with at least serving gemm_attention_min_tokens rows are packed,
    their keys one after another in the gather scratch.

    kv_tokens   their kv_len summed: at most capacity.prefill_gather_tokens (the scratch)
    max_rows    the longest chunk's rows (the launch's query grid)
    max_kv_len  the longest kv_len (the gather's grid)
    """

    first_request: int
    num_requests: int
    kv_tokens: int
    max_rows: int
    max_kv_len: int


def long_prefill_groups(requests: Sequence[LongPrefillRequest], gather_tokens: int) -> tuple[LongPrefillGroup, ...]:
    """``requests`` (in step order) as consecutive groups whose kv_len add up to at most ``gather_tokens``,
    each as long as it can be: one group where the step's keys fit the scratch together (the planner's
    max(C, max_prefill_tokens) holds all of a step's fresh prompts). A request's kv_len is at most
    max_context <= gather_tokens, so each fits alone."""
    groups: list[LongPrefillGroup] = []
    members: list[LongPrefillRequest] = []

    def close() -> None:
        if members:
            groups.append(LongPrefillGroup(members[0].request, members[-1].request - members[0].request + 1,
                                           sum(r.kv_len for r in members), max(r.num_rows for r in members),
                                           max(r.kv_len for r in members)))
            members.clear()

    for request in requests:
        assert request.kv_len <= gather_tokens, "the planner sizes prefill_gather_tokens to at least max_context"
        if members and sum(r.kv_len for r in members) + request.kv_len > gather_tokens:
            close()
        members.append(request)
    close()
    return tuple(groups)


@dataclass(frozen=True)
class StepMetadata:
    """Host arrays of one step (active lengths only) and its counts."""

    num_rows: int
    num_requests: int
    pool: str  # "decode" (every request feeds one token) or "prefill"
    token_ids: np.ndarray  # [rows] int32
    positions: np.ndarray  # [rows] int32
    batch_indices: np.ndarray  # [rows] int32
    q_indptr: np.ndarray  # [requests + 1] int32
    page_indptr: np.ndarray  # [requests + 1] int32
    page_indices: np.ndarray  # [pages] int32
    last_page_len: np.ndarray  # [requests] int32
    request_indices: np.ndarray  # [tiles] int32
    qo_tile_indices: np.ndarray  # [tiles] int32
    kv_tile_indices: np.ndarray  # [tiles] int32
    kv_chunk_size: np.ndarray  # [requests] int32
    logits_indices: np.ndarray  # [requests] int32: each request's last row
    slot_ids: np.ndarray  # [requests] int32
    temperature: np.ndarray  # [requests] float32
    top_k: np.ndarray  # [requests] int32
    top_p: np.ndarray  # [requests] float32
    seeds: np.ndarray  # [requests] int64
    sample_steps: np.ndarray  # [requests] int32
    long_prefill_requests: tuple[LongPrefillRequest, ...] = ()  # the prefill_attention backend's (host only)
    long_prefill_groups: tuple[LongPrefillGroup, ...] = ()  # the same chunks as the flash backend's launches
    # Prefill steps: the last this many tiles are the decode rows' (one-row chunks), which the decode
    # attention kernel serves (routing.py); the tiles before them are the paged kernel's. 0 in decode steps.
    num_decode_row_tiles: int = 0
    # Prefill steps: how many one-row chunks (decode rows) the step starts with, requests and rows
    # 0 .. this - 1, which the decode delta rule serves (routing.py). 0 in decode steps.
    leading_decode_rows: int = 0

    @property
    def num_tiles(self) -> int:
        return int(self.request_indices.shape[0])


def plan_step(plan: MemoryPlan, chunks: Sequence[RequestChunk], page_tables: PageTables | None = None) -> StepMetadata:
    """Host metadata of a step; raises CapacityError naming the first exceeded dimension.

    ``page_tables``: the caller's PageTables, used for the page lists when every chunk names its
    ``page_table_key`` (the engine's; a step's tables are then copied, not converted)."""
    cap = plan.capacity
    page_size = cap.page_size
    _check("batch", len(chunks), cap.max_batch)
    new_tokens = np.array([len(c.token_ids) for c in chunks], dtype=np.int64)
    if (new_tokens < 1).any():
        raise ValueError("every request of a step feeds at least one token")
    kv_lens = np.array([c.num_cached for c in chunks], dtype=np.int64) + new_tokens
    num_rows = int(new_tokens.sum())
    pool = "decode" if (new_tokens == 1).all() else "prefill"
    _check("total_tokens", num_rows, cap.max_tokens_per_step)
    if len(chunks):
        longest = int(kv_lens.argmax())
        _check("context", int(kv_lens[longest]), cap.max_context, f"request {longest}")
    pages_needed = -(-kv_lens // page_size)
    pages_list = pages_needed.tolist()
    for index, chunk in enumerate(chunks):
        if len(chunk.page_ids) < pages_list[index]:
            raise ValueError(
                f"request {index}: {int(kv_lens[index])} tokens need {pages_list[index]} pages, "
                f"its page table lists {len(chunk.page_ids)}"
            )
    num_pages = int(pages_needed.sum())
    _check("page_indices", num_pages, cap.logical_pages)
    page_indices = _page_indices(chunks, pages_list, num_pages, page_tables)
    if page_indices.size and (page_indices.min() < 1 or page_indices.max() >= cap.kv_pages):
        bad = int(page_indices.max() if page_indices.max() >= cap.kv_pages else page_indices.min())
        raise CapacityError("kv_pages", bad + 1, cap.kv_pages, "page ids must lie in 1..kv_pages-1; 0 is padding")
    slots = np.array([c.slot for c in chunks], dtype=np.int64)
    if plan.geometry.num_linear_layers and len(chunks):
        _check("recurrent_slots", int(slots.max()) + 1, cap.recurrent_slots)
        if slots.min() < 0 or len(set(slots.tolist())) != len(slots):
            raise ValueError(f"recurrent slots of a step must be distinct and >= 0, got {slots.tolist()}")
    q_indptr = _indptr(new_tokens)
    page_indptr = _indptr(pages_needed)
    long_requests: tuple[LongPrefillRequest, ...] = ()
    num_decode_row_tiles = 0
    if pool == "decode" and len(chunks):
        tiles = plan_decode_tiles(kv_lens, decode_kv_chunk(plan, kv_lens), cap.decode_kv_splits)
    else:
        tiles = plan_tiles(q_indptr, kv_lens, rows_per_tile=PREFILL_ROWS_PER_TILE)
        long_requests = long_prefill_requests(plan, q_indptr, kv_lens, page_indptr)
        tiles, num_decode_row_tiles = _prefill_tiles(tiles, new_tokens, [r.request for r in long_requests])
    _check("tiles", int(tiles[0].shape[0]), cap.tiles)
    rows_request = np.repeat(np.arange(len(chunks)), new_tokens)
    first_position = kv_lens - new_tokens
    positions = first_position[rows_request] + (np.arange(num_rows) - q_indptr[:-1][rows_request])
    return StepMetadata(
        num_rows=num_rows,
        num_requests=len(chunks),
        pool=pool,
        token_ids=_i32(np.fromiter(chain.from_iterable(c.token_ids for c in chunks), dtype=np.int64, count=num_rows)),
        positions=_i32(positions),
        batch_indices=_i32(rows_request),
        q_indptr=_i32(q_indptr),
        page_indptr=_i32(page_indptr),
        page_indices=_i32(page_indices),
        last_page_len=_i32(kv_lens - (pages_needed - 1) * page_size),
        request_indices=tiles[0],
        qo_tile_indices=tiles[1],
        kv_tile_indices=tiles[2],
        kv_chunk_size=tiles[3],
        logits_indices=_i32(q_indptr[1:] - 1),
        slot_ids=_i32(slots),
        temperature=np.array([c.temperature for c in chunks], dtype=np.float32),
        top_k=_i32([c.top_k for c in chunks]),
        top_p=np.array([c.top_p for c in chunks], dtype=np.float32),
        seeds=np.array([c.seed for c in chunks], dtype=np.int64),
        sample_steps=_i32([c.sample_step for c in chunks]),
        long_prefill_requests=long_requests,
        long_prefill_groups=long_prefill_groups(long_requests, cap.prefill_gather_tokens),
        num_decode_row_tiles=num_decode_row_tiles,
        leading_decode_rows=0 if pool == "decode" else int(np.argmax(new_tokens != 1)),
    )


def _prefill_tiles(tiles: tuple[np.ndarray, ...], new_tokens: np.ndarray,
                   long_requests: list[int]) -> tuple[tuple[np.ndarray, ...], int]:
    """A prefill step's attention tiles in launch order, and how many of them are decode rows': the
    paged kernel's (chunks of several rows short of the long-chunk backend), then one tile per decode
    row (a one-row chunk: ``plan_tiles`` with no split gives it a single tile over its whole kv_len,
    the decode kernels' direct tile). The long chunks (``long_requests``) get none: their backend
    runs them."""
    rows = new_tokens[tiles[0]]
    routed = np.zeros(new_tokens.shape[0], dtype=bool)
    routed[long_requests] = True
    paged = (rows > 1) & ~routed[tiles[0]]
    decode = (rows == 1) & ~routed[tiles[0]]
    order = np.concatenate([np.flatnonzero(paged), np.flatnonzero(decode)])
    return (tiles[0][order], tiles[1][order], tiles[2][order], tiles[3]), int(decode.sum())


def long_prefill_requests(plan: MemoryPlan, q_indptr: np.ndarray, kv_lens: np.ndarray,
                          page_indptr: np.ndarray) -> tuple[LongPrefillRequest, ...]:
    """The requests of a prefill step whose chunk is long enough (serving gemm_attention_min_tokens)
    for the plan's prefill_attention backend, when the plan has its gather scratch
    (capacity.prefill_gather_tokens > 0)."""
    if not plan.capacity.prefill_gather_tokens:
        return ()
    min_rows = plan.serving.gemm_attention_min_tokens
    requests = []
    for index, rows in enumerate(np.diff(q_indptr).tolist()):
        if rows >= min_rows:
            kv_len = int(kv_lens[index])
            requests.append(LongPrefillRequest(index, int(q_indptr[index]), rows, kv_len, int(page_indptr[index]),
                                               _rows_per_tile(plan, rows, kv_len)))
    return tuple(requests)


def _rows_per_tile(plan: MemoryPlan, rows: int, kv_len: int) -> int:
    """Query rows per attention pass of a chunk of ``rows`` rows over ``kv_len`` keys.

    flash: all of them, one launch (the kernel keeps its scores on chip). gemm: the most whose
    scores fit the score tile; a tile of R rows needs Hq x R x kv_len scores at most (its last row
    sees kv_len keys), and the planner made prefill_score_elements >= Hq x max_context, so R >= 1.
    """
    if plan.capacity.prefill_attention == "flash":
        return rows
    rows_per_tile = min(rows, plan.capacity.prefill_score_elements // (plan.geometry.num_q_heads * kv_len))
    assert rows_per_tile >= 1, "the planner sizes prefill_score_elements >= Hq x max_context"
    return rows_per_tile


def pad_decode(plan: MemoryPlan, meta: StepMetadata, bucket: int) -> StepMetadata:
    """``meta`` (a decode step) padded to ``bucket`` requests, the fixed shape of a decode CUDA graph.

    A padding request feeds token 0 at position 0 on page 0 (the padding page, never handed to a
    request, so its KV write lands nowhere that is read), has recurrent slot -1 (the recurrent
    kernels skip it), samples greedily, and owns no attention tile: its rows are computed and
    thrown away, and no real row reads them. The tile list is padded with -1 to
    ``decode_grid_tiles(plan, bucket)`` entries, the graph's fixed attention grid.
    """
    assert meta.pool == "decode" and meta.num_requests <= bucket <= plan.capacity.max_batch
    pad = bucket - meta.num_requests
    num_tiles = decode_grid_tiles(plan, bucket)
    assert meta.num_tiles <= num_tiles and meta.page_indices.shape[0] + pad <= plan.capacity.logical_pages
    zeros, ones = np.zeros(pad, np.int32), np.ones(pad, np.int32)
    ramp = np.arange(meta.num_requests + 1, bucket + 1, dtype=np.int32)  # indptr tails: one row or page each
    no_tiles = num_tiles - meta.num_tiles
    tile_pad, tile_zeros = np.full(no_tiles, -1, np.int32), np.zeros(no_tiles, np.int32)
    return StepMetadata(
        num_rows=bucket,
        num_requests=bucket,
        pool="decode",
        token_ids=np.concatenate([meta.token_ids, zeros]),
        positions=np.concatenate([meta.positions, zeros]),
        batch_indices=np.arange(bucket, dtype=np.int32),
        q_indptr=np.arange(bucket + 1, dtype=np.int32),
        page_indptr=np.concatenate([meta.page_indptr, ramp - meta.num_requests + meta.page_indptr[-1]]),
        page_indices=np.concatenate([meta.page_indices, zeros]),
        last_page_len=np.concatenate([meta.last_page_len, ones]),
        request_indices=np.concatenate([meta.request_indices, tile_pad]),
        qo_tile_indices=np.concatenate([meta.qo_tile_indices, tile_zeros]),
        kv_tile_indices=np.concatenate([meta.kv_tile_indices, tile_zeros]),
        kv_chunk_size=np.concatenate([meta.kv_chunk_size, np.full(pad, NO_SPLIT_CHUNK, np.int32)]),
        logits_indices=np.arange(bucket, dtype=np.int32),
        slot_ids=np.concatenate([meta.slot_ids, -ones]),
        temperature=np.concatenate([meta.temperature, np.zeros(pad, np.float32)]),
        top_k=np.concatenate([meta.top_k, zeros]),
        top_p=np.concatenate([meta.top_p, np.ones(pad, np.float32)]),
        seeds=np.concatenate([meta.seeds, np.zeros(pad, np.int64)]),
        sample_steps=np.concatenate([meta.sample_steps, zeros]),
    )


def decode_grid_tiles(plan: MemoryPlan, bucket: int) -> int:
    """Attention tiles of a decode graph of ``bucket`` requests: the most any step of at most
    ``bucket`` requests gets from ``decode_kv_splits``, so the graph's fixed grid has few padding
    blocks. (Sizing it for every row split decode_kv_splits ways, 16,384 blocks at bucket 64 on
    Qwen3-8B where a step runs 512, cost the step tens of microseconds a layer in dispatching
    blocks that only exit.)

    n requests get n x min(decode_kv_splits, max(1, F // (n x Hkv))) tiles (``decode_splits``, F =
    ``_wave_blocks``): at most F // Hkv while n x Hkv <= F (n x floor(F / (n x Hkv)) <= F / Hkv), n <=
    bucket past it, and never more than bucket x decode_kv_splits.
    """
    few_pairs = _wave_blocks(plan) // plan.geometry.num_kv_heads
    return max(bucket, min(bucket * plan.capacity.decode_kv_splits, few_pairs))


def decode_splits(plan: MemoryPlan, num_requests: int) -> int:
    """Most kv chunks a row of a decode step of ``num_requests`` requests is split into.

    A decode row is one query, so without splitting the step has only B x Hkv blocks (8 at
    batch 1 on Qwen3-8B, for 132 SMs). Aim for at most FEW_BLOCKS_PER_SM blocks an SM, the most the
    tensor-core decode kernel keeps resident (more would run in a second wave), and never more
    chunks than the plan's decode_kv_splits (the split scratch depth).
    """
    blocks = num_requests * plan.geometry.num_kv_heads
    return max(1, min(plan.capacity.decode_kv_splits, _wave_blocks(plan) // blocks))


def _wave_blocks(plan: MemoryPlan) -> int:
    """Decode attention blocks a step aims to run at once: FEW_BLOCKS_PER_SM on each of the plan's SMs."""
    return FEW_BLOCKS_PER_SM * plan.hardware.num_sms


def decode_kv_chunk(plan: MemoryPlan, kv_lens: np.ndarray) -> int:
    """KV tokens per attention tile of a decode step: a whole number of MIN_KV_CHUNK_TOKENS (the
    attention kernels' 64-key block), at least the longest row over ``decode_splits``, so no row
    has more chunks than that."""
    chunk = -(-int(kv_lens.max()) // decode_splits(plan, len(kv_lens)))
    return -(-chunk // MIN_KV_CHUNK_TOKENS) * MIN_KV_CHUNK_TOKENS


def _page_indices(chunks: Sequence[RequestChunk], pages_needed: list[int], num_pages: int,
                  page_tables: PageTables | None) -> np.ndarray:
    """The step's page tables, concatenated [num_pages]."""
    if page_tables is not None and all(c.page_table_key is not None for c in chunks):
        tables = [page_tables.table(c.page_table_key, c.page_ids, n) for c, n in zip(chunks, pages_needed)]
        page_tables.end_step()
        return np.concatenate(tables) if tables else np.empty(0, np.int32)
    # One pass over the Python lists (a conversion per request cost ~13 us each at 257 pages).
    tables = (islice(c.page_ids, n) for c, n in zip(chunks, pages_needed))
    return np.fromiter(chain.from_iterable(tables), dtype=np.int64, count=num_pages)


def _check(dimension: str, required: int, capacity: int, detail: str = "") -> None:
    if required > capacity:
        raise CapacityError(dimension, required, capacity, detail)


def _indptr(counts: np.ndarray) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(counts)]).astype(np.int64)


def _i32(values) -> np.ndarray:
    return np.ascontiguousarray(np.asarray(values, dtype=np.int64).astype(np.int32))
