"""``materialize``: one device allocation per planned pool, a view per planned buffer.

This is the only place the executor allocates device memory. Every view sits at
its planned offset with its planned dtype and shape (invariant 1,
docs/design.md), and keeps its address for the arena's lifetime (invariant 5).
Pools that are budget lines only (``materialized: false``, e.g. the CUDA
context) are not allocated. With tensor parallelism every rank materializes the
same per-rank plan on its own device; the arena names its rank, which says
where its weight shards come from (planner/shards.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field
import torch

from executor.device import TORCH_DTYPES, Device
from planner.plan import MemoryPlan

#: Byte pattern written over every non-weight pool at materialize: NaN in any
#: float dtype, -1 in ints, so a read of something never written shows up.
POISON_BYTE = 0xFF


@dataclass
class Arena:
    """The materialized plan: raw pool allocations and typed views into them."""

    plan: MemoryPlan
    device: Device
    rank: int = 0  # the tensor-parallel rank whose shards the weights pool holds
    pools: dict[str, torch.Tensor] = field(default_factory=dict)
    _views: dict[tuple[str, str], torch.Tensor] = field(default_factory=dict)

    def tensor(self, pool: str, name: str) -> torch.Tensor:
        """The torch view of a planned buffer (or fused view)."""
        try:
            return self._views[(pool, name)]
        except KeyError:
            raise KeyError(f"the plan has no buffer {pool}/{name}") from None

    def names(self, pool: str) -> list[str]:
        return [name for (p, name) in self._views if p == pool]

    @property
    def allocated_bytes(self) -> int:
        return sum(raw.numel() for raw in self.pools.values())


def materialize(plan: MemoryPlan, device: Device, rank: int = 0) -> Arena:
    """Allocate every materialized pool once and carve its buffers out of it, for tensor-parallel
    ``rank`` (0 .. tensor_parallel_size - 1) of the plan."""
    tp = plan.serving.tensor_parallel_size
    if not 0 <= rank < tp:
        raise ValueError(f"rank {rank} is outside the plan's tensor_parallel_size {tp} (ranks 0 .. {tp - 1})")
    arena = Arena(plan, device, rank)
    for pool in plan.pools:
        if not pool.materialized:
            continue
        raw = torch.empty(pool.bytes, dtype=torch.uint8, device=device.torch_device)
        raw.fill_(0 if pool.name == "weights" else POISON_BYTE)  # weights: alignment padding stays defined
        arena.pools[pool.name] = raw
        for buffer in (*pool.buffers, *pool.fused):
            arena._views[(pool.name, buffer.name)] = _view(raw, buffer.offset, buffer.bytes, buffer.dtype, buffer.shape)
    return arena


def _view(raw: torch.Tensor, offset: int, nbytes: int, dtype: str, shape: tuple[int, ...]) -> torch.Tensor:
    return raw[offset : offset + nbytes].view(TORCH_DTYPES[dtype]).view(shape)
