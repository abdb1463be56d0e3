"""Qwen3.5 text stack: Gated DeltaNet layers with a gated full-attention layer
every few; zero-centred RMSNorm ``norm(x) * (1 + w)``; partial RoPE."""

from __future__ import annotations

from executor.arena import Arena
from executor.models.blocks import FullAttention, LinearAttention, Mlp
from executor.models.decoder import DecoderModel, Layer
from executor.models.kernels import ZERO_CENTRED_NORM, build_kernels


def build_qwen3_5(arena: Arena) -> DecoderModel:
    plan = arena.plan
    kernels = build_kernels(plan.geometry, plan.dtypes.activations, ZERO_CENTRED_NORM)
    mixers = {
        "full_attention": lambda i: FullAttention(arena, kernels, i, ZERO_CENTRED_NORM, output_gate=True),
        "linear_attention": lambda i: LinearAttention(arena, kernels, i),
    }
    layers = [
        Layer(
            mixer=mixers[kind](i),
            mlp=Mlp(arena, kernels, i),
            input_norm=arena.tensor("weights", f"model.layers.{i}.input_layernorm.weight"),
            post_norm=arena.tensor("weights", f"model.layers.{i}.post_attention_layernorm.weight"),
        )
        for i, kind in enumerate(plan.geometry.layer_kinds)
    ]
    return DecoderModel(arena, kernels, ZERO_CENTRED_NORM, layers)
