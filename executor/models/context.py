"""``StepViews``: the planned buffers of one step, sliced to its active sizes.

Built per step from the arena's fixed views (slicing allocates nothing); every
block of the forward reads and writes only these. A CUDA-graph bucket's views
(``bucket_views``) have the bucket's fixed sizes instead, since a graph bakes
in every shape and address.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property
from typing import Any

import torch

from executor.arena import Arena
from executor.step import LongPrefillGroup, LongPrefillRequest, StepMetadata


#: The attention-plan buffers of an attention launch, in its argument order.
TILE_META = ("page_indices", "page_indptr", "last_page_len", "q_indptr", "batch_indices", "positions",
             "request_indices", "qo_tile_indices", "kv_tile_indices", "kv_chunk_size", "total_num_rows")


@dataclass(frozen=True)
class StepViews:
    num_rows: int
    num_requests: int
    num_pages: int
    num_tiles: int
    pool: str
    arena: Arena
    stream: Any  # the Numba stream kernels launch on: torch's current stream (device.current_stream())
    long_prefill_requests: tuple[LongPrefillRequest, ...] = ()  # chunks the prefill_attention backend runs
    long_prefill_groups: tuple[LongPrefillGroup, ...] = ()  # the same chunks, packed (the flash backend's)
    num_decode_row_tiles: int = 0  # prefill steps: the last tiles, the decode rows' (StepMetadata)
    leading_decode_rows: int = 0  # prefill steps: the one-row chunks the step starts with (StepMetadata)
    # Rows the step's row-wise pieces run at: its prefill graph bucket when it replays one (graphs.py), else
    # num_rows. A block that splits work between a piece and its eager part decides by this, so both agree.
    piece_rows: int = 0

    def __post_init__(self) -> None:
        if not self.piece_rows:
            object.__setattr__(self, "piece_rows", self.num_rows)

    def scratch(self, name: str) -> torch.Tensor:
        """A whole planned buffer of the step's pool (scratch not laid out by row)."""
        return self.arena.tensor(self.pool, name)

    def role(self, name: str) -> torch.Tensor:
        """A role buffer of the step's pool (decode or prefill), first ``num_rows`` rows (sliced once a step:
        every layer asks for the same views)."""
        view = self._roles.get(name)
        if view is None:
            view = self._roles[name] = self.arena.tensor(self.pool, name)[: self.num_rows]
        return view

    def meta(self, name: str) -> torch.Tensor:
        """An attention-plan buffer sliced to this step's active length."""
        return self._meta[name]

    @cached_property
    def _roles(self) -> dict[str, torch.Tensor]:
        return {}

    @cached_property
    def _meta(self) -> dict[str, torch.Tensor]:
        """Every attention-plan buffer sliced to the step's active length, once a step."""
        lengths = {
            "page_indices": self.num_pages,
            "page_indptr": self.num_requests + 1,
            "q_indptr": self.num_requests + 1,
            "last_page_len": self.num_requests,
            "kv_chunk_size": self.num_requests,
            "batch_indices": self.num_rows,
            "positions": self.num_rows,
            "request_indices": self.num_tiles,
            "qo_tile_indices": self.num_tiles,
            "kv_tile_indices": self.num_tiles,
            "total_num_rows": 1,
        }
        return {name: self.arena.tensor("attention_plan", name)[:length] for name, length in lengths.items()}

    @cached_property
    def tile_meta(self) -> tuple[torch.Tensor, ...]:
        """The attention metadata every attention launch of the step takes, in the launchers' order
        (page_indices .. total_num_rows): sliced once per step, shared by every layer."""
        return tuple(self.meta(name) for name in TILE_META)

    @cached_property
    def split_tile_meta(self) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
        """A prefill step's ``tile_meta`` as two launches': the paged kernel's tiles, then the decode
        rows' (the same metadata with the tile arrays sliced; no copy)."""
        meta, split = self.tile_meta, self.num_tiles - self.num_decode_row_tiles
        first, last = TILE_META.index("request_indices"), TILE_META.index("kv_tile_indices") + 1
        tiles = meta[first:last]
        return (meta[:first] + tuple(t[:split] for t in tiles) + meta[last:],
                meta[:first] + tuple(t[split:] for t in tiles) + meta[last:])

    def slot_ids(self) -> torch.Tensor:
        return self.arena.tensor("recurrent_state", "slot_ids")[: self.num_requests]


def step_views(arena: Arena, meta: StepMetadata) -> StepViews:
    """The views of ``meta``'s active sizes, on the current stream."""
    return StepViews(
        num_rows=meta.num_rows,
        num_requests=meta.num_requests,
        num_pages=int(meta.page_indices.shape[0]),
        num_tiles=meta.num_tiles,
        pool=meta.pool,
        arena=arena,
        stream=arena.device.current_stream(),
        long_prefill_requests=meta.long_prefill_requests,
        long_prefill_groups=meta.long_prefill_groups,
        num_decode_row_tiles=meta.num_decode_row_tiles,
        leading_decode_rows=meta.leading_decode_rows,
    )


def bucket_views(arena: Arena, bucket: int, num_tiles: int) -> StepViews:
    """The views of a decode step padded to ``bucket`` requests (see step.pad_decode): one row per
    request, the whole page table (its used length varies from step to step) and ``num_tiles``
    attention tiles (the padded tail is -1)."""
    return StepViews(
        num_rows=bucket,
        num_requests=bucket,
        num_pages=arena.plan.capacity.logical_pages,
        num_tiles=num_tiles,
        pool="decode",
        arena=arena,
        stream=arena.device.current_stream(),
    )


def prefill_bucket_views(arena: Arena, bucket: int) -> StepViews:
    """The row views of a prefill step padded to ``bucket`` rows, as the prefill graphs' pieces see it:
    they read and write row buffers only (no attention metadata, no request)."""
    return StepViews(
        num_rows=bucket,
        num_requests=0,
        num_pages=0,
        num_tiles=0,
        pool="prefill",
        arena=arena,
        stream=arena.device.current_stream(),
    )
