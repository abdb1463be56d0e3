"""Qwen3.5 text stack: Gated DeltaNet layers with a gated full-attention layer
every few; zero-centred RMSNorm ``norm(x) * (1 + w)``; partial RoPE."""

from __future__ import annotations

from executor.arena import Arena
from executor.models.blocks import FullAttention, LinearAttention
from executor.models.decoder import DecoderModel
from executor.parallel import TensorParallel
from executor.models.launchers import ZERO_CENTRED_NORM, build_kernels
from executor.models.projections import Projections


def build_qwen3_5(arena: Arena, parallel: TensorParallel | None = None) -> DecoderModel:
    plan = arena.plan
    kernels = build_kernels(plan.geometry, plan.dtypes.activations, ZERO_CENTRED_NORM, plan.hardware.num_sms,
                            plan.capacity.page_size, plan.hardware.compute_capability)
    mixers = {
        "full_attention": lambda i, proj: FullAttention(arena, kernels, proj, i, ZERO_CENTRED_NORM, output_gate=True),
        "linear_attention": lambda i, proj: LinearAttention(arena, kernels, proj, i),
    }

    def build_mixer(i: int, proj: Projections):
        return mixers[plan.geometry.layer_kinds[i]](i, proj)

    return DecoderModel(arena, kernels, ZERO_CENTRED_NORM, build_mixer, parallel)
