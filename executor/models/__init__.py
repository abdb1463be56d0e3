"""Model builders by architecture: a new model is a new module registered here."""

from __future__ import annotations

from typing import TYPE_CHECKING

from executor.arena import Arena
from executor.models.decoder import DecoderModel

if TYPE_CHECKING:
    from executor.parallel import TensorParallel


def build_model(arena: Arena, parallel: TensorParallel | None = None) -> DecoderModel:
    """The model of ``arena.plan`` wired to the arena's views; ``parallel``: its tensor-parallel group
    (executor/parallel.py), None on one device."""
    from executor.models.qwen3 import build_qwen3
    from executor.models.qwen3_5 import build_qwen3_5

    builders = {"qwen3": build_qwen3, "qwen3_5": build_qwen3_5}
    return builders[arena.plan.model.architecture](arena, parallel)
