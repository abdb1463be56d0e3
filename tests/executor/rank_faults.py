"""Worker ranks that fail on purpose (tests only): passed as ``Ranks.start(..., worker=...)``, they run in
the spawned rank processes, so they live in a module those processes import."""

from __future__ import annotations

import time

from executor.workers import RankSpec, serve_rank

#: The error text the failing workers raise, which rank 0's RankError must carry.
FAULT = "injected fault"


def fail_at_start(spec: RankSpec, rank: int, local_rank: int) -> None:
    """Raise before joining the group (as a worker whose imports or GPU fail does)."""
    raise OSError(f"{FAULT} before joining the group")


def fail_at_first_step(spec: RankSpec, rank: int, local_rank: int) -> None:
    """Serve the rank, raising in the first step rank 0 announces (after the group and the model exist)."""
    from executor.models.decoder import DecoderModel

    def step(self, meta, pad_to=None):
        raise ValueError(f"{FAULT} in a step on rank {rank}")

    DecoderModel.step = step
    serve_rank(spec, rank, local_rank)


def hang_at_first_step(spec: RankSpec, rank: int, local_rank: int) -> None:
    """Serve the rank, stopping to answer in the first step (a rank stuck outside any collective)."""
    from executor.models.decoder import DecoderModel

    def step(self, meta, pad_to=None):
        time.sleep(3600.0)

    DecoderModel.step = step
    serve_rank(spec, rank, local_rank)
