"""Qwen3: every layer full attention; RMSNorm ``w * norm(x)``; no output gate."""

from __future__ import annotations

from executor.arena import Arena
from executor.models.blocks import FullAttention
from executor.models.decoder import DecoderModel
from executor.parallel import TensorParallel
from executor.models.launchers import QWEN3_NORM, build_kernels


def build_qwen3(arena: Arena, parallel: TensorParallel | None = None) -> DecoderModel:
    plan = arena.plan
    kernels = build_kernels(plan.geometry, plan.dtypes.activations, QWEN3_NORM, plan.hardware.num_sms,
                            plan.capacity.page_size, plan.hardware.compute_capability)
    return DecoderModel(arena, kernels, QWEN3_NORM,
                        lambda i, proj: FullAttention(arena, kernels, proj, i, QWEN3_NORM, output_gate=False),
                        parallel)
