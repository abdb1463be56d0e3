"""Qwen3: every layer full attention; RMSNorm ``w * norm(x)``; no output gate."""

from __future__ import annotations

from executor.arena import Arena
from executor.models.blocks import FullAttention, Mlp
from executor.models.decoder import DecoderModel, Layer
from executor.models.kernels import QWEN3_NORM, build_kernels
from executor.models.projections import layer_projections


def build_qwen3(arena: Arena) -> DecoderModel:
    plan = arena.plan
    kernels = build_kernels(plan.geometry, plan.dtypes.activations, QWEN3_NORM)

    def build_layer(i: int, gemv: bool) -> Layer:
        input_norm = arena.tensor("weights", f"model.layers.{i}.input_layernorm.weight")
        post_norm = arena.tensor("weights", f"model.layers.{i}.post_attention_layernorm.weight")
        mixer_proj, mlp_proj = layer_projections(kernels, QWEN3_NORM, plan.model.rms_norm_eps, input_norm, post_norm,
                                                 gemv)
        return Layer(
            mixer=FullAttention(arena, kernels, mixer_proj, i, QWEN3_NORM, output_gate=False),
            mlp=Mlp(arena, mlp_proj, i),
            input_norm=input_norm,
            post_norm=post_norm,
        )

    return DecoderModel(arena, kernels, QWEN3_NORM, build_layer)
