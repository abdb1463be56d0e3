"""``StepViews``: the planned buffers of one step, sliced to its active sizes.

Built per step from the arena's fixed views (slicing allocates nothing); every
block of the forward reads and writes only these.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.arena import Arena
from executor.step import StepMetadata


@dataclass(frozen=True)
class StepViews:
    num_rows: int
    num_requests: int
    num_pages: int
    num_tiles: int
    pool: str
    arena: Arena

    def role(self, name: str) -> torch.Tensor:
        """A role buffer of the step's pool (decode or prefill), first ``num_rows`` rows."""
        return self.arena.tensor(self.pool, name)[: self.num_rows]

    def meta(self, name: str) -> torch.Tensor:
        """An attention-plan buffer sliced to this step's active length."""
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
        return self.arena.tensor("attention_plan", name)[: lengths[name]]

    def slot_ids(self) -> torch.Tensor:
        return self.arena.tensor("recurrent_state", "slot_ids")[: self.num_requests]


def step_views(arena: Arena, meta: StepMetadata) -> StepViews:
    return StepViews(
        num_rows=meta.num_rows,
        num_requests=meta.num_requests,
        num_pages=int(meta.page_indices.shape[0]),
        num_tiles=meta.num_tiles,
        pool=meta.pool,
        arena=arena,
    )
