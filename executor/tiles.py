"""Work tiles of one attention launch, planned on the host (numpy; no torch, no numba).

A tile is (request, query tile, kv chunk): the paged attention kernel's grid is (tiles, Hkv), and
the decode kernels read the same arrays (executor/kernels/attention/paged.py's docstring has the
scheme). ``plan_tiles`` serves any step; ``plan_decode_tiles`` is its few-call form for decode steps.
"""

from __future__ import annotations

from typing import Any

import numpy as np

#: kv_chunk_size of padding requests: never splits.
NO_SPLIT_CHUNK = np.iinfo(np.int32).max


def plan_tiles(
    q_indptr: Any,
    kv_lens: Any,
    *,
    rows_per_tile: int = 1,
    kv_chunk: int | None = None,
    max_splits: int = 1,
    out: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Fill the work tiles of one step (host side, numpy).

    q_indptr [B+1] (rows of request b are q_indptr[b]..q_indptr[b+1]-1, the last n_b
    positions of its kv_len), kv_lens [B] (tokens after this step). ``kv_chunk``: kv
    tokens per kv tile (None: the whole kv_len, no split); a row then has
    ``p // chunk + 1`` chunks, which must be <= ``max_splits`` (the split scratch depth).
    Returns int32 ``(request_indices [N], qo_tile_indices [N], kv_tile_indices [N],
    kv_chunk_size [B])`` ordered request-major, then query tile, then kv chunk. With
    ``out`` (four capacity-sized int32 buffers) the tiles are written there, the unused
    tail of request_indices is set to -1 (padding tiles) and of kv_chunk_size to
    INT32_MAX (never split), and views of the active parts are returned.
    """
    q_indptr = np.asarray(q_indptr, dtype=np.int64)
    kv_lens = np.asarray(kv_lens, dtype=np.int64)
    num_requests = kv_lens.shape[0]
    if q_indptr.shape != (num_requests + 1,):
        raise ValueError(f"plan_tiles: q_indptr has shape {q_indptr.shape}, expected ({num_requests + 1},)")
    rows = np.diff(q_indptr)
    if (rows < 0).any() or (kv_lens < rows).any() or ((rows > 0) & (kv_lens < 1)).any():
        raise ValueError("plan_tiles: need 0 <= rows of request b <= kv_lens[b] (and kv_len >= 1 with rows)")
    chunk = np.maximum(kv_lens, 1) if kv_chunk is None else np.minimum(np.int64(kv_chunk), np.maximum(kv_lens, 1))
    if (chunk < 1).any():
        raise ValueError(f"plan_tiles: kv_chunk must be >= 1, got {kv_chunk}")
    splits = np.where(rows > 0, (kv_lens - 1) // chunk + 1, 1)
    _check_splits(splits, max_splits)
    # Query tiles: per request ceil(n_b / R); the last row of tile qo has position
    # kv_len - n_b + min((qo + 1) R, n_b) - 1, which bounds the tile's kv chunks.
    qo_per_request = -(-rows // rows_per_tile)
    qo_request = np.repeat(np.arange(num_requests), qo_per_request)
    qo_start = np.repeat(np.cumsum(qo_per_request) - qo_per_request, qo_per_request)
    qo_index = np.arange(qo_request.shape[0]) - qo_start
    n_b = rows[qo_request]
    last_pos = kv_lens[qo_request] - n_b + np.minimum((qo_index + 1) * rows_per_tile, n_b) - 1
    kv_per_qo = last_pos // chunk[qo_request] + 1
    tile_start = np.repeat(np.cumsum(kv_per_qo) - kv_per_qo, kv_per_qo)
    tiles = (
        np.repeat(qo_request, kv_per_qo).astype(np.int32),
        np.repeat(qo_index, kv_per_qo).astype(np.int32),
        (np.arange(tile_start.shape[0]) - tile_start).astype(np.int32),
    )
    chunk32 = chunk.astype(np.int32)
    if out is None:
        return tiles[0], tiles[1], tiles[2], chunk32
    num_tiles = tiles[0].shape[0]
    if num_tiles > out[0].shape[0]:
        raise ValueError(f"attention tiles: need {num_tiles}, planned {out[0].shape[0]}")
    if num_requests > out[3].shape[0]:
        raise ValueError(f"attention kv_chunk_size: need {num_requests} requests, planned {out[3].shape[0]}")
    for buffer, values in zip(out[:3], tiles):
        buffer[:num_tiles] = values
    out[0][num_tiles:] = -1
    out[3][:num_requests] = chunk32
    out[3][num_requests:] = NO_SPLIT_CHUNK
    return out[0][:num_tiles], out[1][:num_tiles], out[2][:num_tiles], out[3][:num_requests]


def plan_decode_tiles(kv_lens: np.ndarray, kv_chunk: int,
                      max_splits: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``plan_tiles`` for a decode step (one row per request, at position kv_len - 1), in the few
    numpy calls that case needs: the decode host path runs every step, and the general planner's
    checks and query-tile bookkeeping cost ~0.1 ms of it at batch 1. kv_lens int64 [B] >= 1."""
    chunk = np.minimum(np.int64(kv_chunk), kv_lens)
    splits = (kv_lens - 1) // chunk + 1
    _check_splits(splits, max_splits)
    num_tiles = int(splits.sum())
    request_indices = np.repeat(np.arange(kv_lens.shape[0], dtype=np.int32), splits)
    starts = np.repeat(np.cumsum(splits) - splits, splits)
    kv_tile_indices = (np.arange(num_tiles) - starts).astype(np.int32)
    return request_indices, np.zeros(num_tiles, np.int32), kv_tile_indices, chunk.astype(np.int32)


def _check_splits(splits: np.ndarray, max_splits: int) -> None:
    """Each request's kv chunks [B] fit the split scratch depth, or a ValueError naming the request."""
    if splits.size and splits.max() > max_splits:
        raise ValueError(
            f"attention kv splits: need {int(splits.max())}, planned {max_splits} (request {int(splits.argmax())})"
        )
