"""Qwen3: every layer full attention; RMSNorm ``w * norm(x)``; no output gate."""

from __future__ import annotations

from executor.arena import Arena
from executor.models.blocks import FullAttention, Mlp
from executor.models.decoder import DecoderModel, Layer
from executor.models.kernels import QWEN3_NORM, build_kernels


def build_qwen3(arena: Arena) -> DecoderModel:
    plan = arena.plan
    kernels = build_kernels(plan.geometry, plan.dtypes.activations, QWEN3_NORM)
    layers = [
        Layer(
            mixer=FullAttention(arena, kernels, i, QWEN3_NORM, output_gate=False),
            mlp=Mlp(arena, kernels, i),
            input_norm=arena.tensor("weights", f"model.layers.{i}.input_layernorm.weight"),
            post_norm=arena.tensor("weights", f"model.layers.{i}.post_attention_layernorm.weight"),
        )
        for i in range(plan.geometry.num_layers)
    ]
    return DecoderModel(arena, kernels, QWEN3_NORM, layers)
