"""Qwen3.5 text stack: Gated DeltaNet layers with a gated full-attention layer
every few; zero-centred RMSNorm ``norm(x) * (1 + w)``; partial RoPE."""

from __future__ import annotations

from executor.arena import Arena
from executor.models.blocks import FullAttention, LinearAttention, Mlp
from executor.models.decoder import DecoderModel, Layer
from executor.models.kernels import ZERO_CENTRED_NORM, build_kernels
from executor.models.projections import layer_projections


def build_qwen3_5(arena: Arena) -> DecoderModel:
    plan = arena.plan
    kernels = build_kernels(plan.geometry, plan.dtypes.activations, ZERO_CENTRED_NORM)
    mixers = {
        "full_attention": lambda i, proj: FullAttention(arena, kernels, proj, i, ZERO_CENTRED_NORM, output_gate=True),
        "linear_attention": lambda i, proj: LinearAttention(arena, kernels, proj, i),
    }

    def build_layer(i: int, gemv: bool) -> Layer:
        input_norm = arena.tensor("weights", f"model.layers.{i}.input_layernorm.weight")
        post_norm = arena.tensor("weights", f"model.layers.{i}.post_attention_layernorm.weight")
        mixer_proj, mlp_proj = layer_projections(kernels, ZERO_CENTRED_NORM, plan.model.rms_norm_eps, input_norm,
                                                 post_norm, gemv)
        return Layer(
            mixer=mixers[plan.geometry.layer_kinds[i]](i, mixer_proj),
            mlp=Mlp(arena, mlp_proj, i),
            input_norm=input_norm,
            post_norm=post_norm,
        )

    return DecoderModel(arena, kernels, ZERO_CENTRED_NORM, build_layer)
