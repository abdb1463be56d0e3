"""The kernel launchers a model uses, built once per model (one compile per
kernel and argument types, shared by every layer)."""

from __future__ import annotations

from dataclasses import dataclass

from executor.kernels.rows.activation import SiluMul
from executor.kernels.attention.paged import PagedAttention
from executor.kernels.attention.causal_softmax import CausalSoftmax
from executor.kernels.rows.chunk_copy import ChunkCopy
from executor.kernels.primitives.codec import build_codec
from executor.kernels.linear_attention.conv1d import CausalConv1d
from executor.kernels.attention.decode import DecodeAttention
from executor.kernels.attention.decode_rope import DecodeRopeAttention
from executor.kernels.linear_attention.chunked_delta_rule import ChunkedGatedDeltaRule
from executor.kernels.linear_attention.delta_rule import GatedDeltaRule, GdnGates
from executor.kernels.linear_attention.delta_rule_decode import GatedDeltaRuleDecode
from executor.kernels.rows.embedding import Embedding
from executor.kernels.attention.flash import FlashAttention
from executor.kernels.attention.flash_wgmma import WarpgroupFlashAttention
from executor.kernels.rows.gated_norm import GatedRmsNorm
from executor.kernels.gemv import Gemv
from executor.kernels.attention.gather import GatherKv, PackedGatherKv
from executor.kernels.rows.norm import AddRmsNormInplace, RmsNorm
from executor.kernels.rows.output_gate import SigmoidMulInplace
from executor.kernels.rope.fused_kv_write import QkNormRopeWriteKv
from executor.kernels.sampling.sampler import Sample
from executor.numba_cuda import simulator_enabled
from executor import routing
from executor.routing import PREFILL_ROWS_PER_TILE
from planner.geometry import Geometry


@dataclass(frozen=True)
class NormStyle:
    """How a model's RMSNorms scale: ``w * norm(x)`` (Qwen3) or ``norm(x) * (1 + w)`` (Qwen3.5)."""

    weight_offset: float
    round_before_weight: bool  # Qwen3 rounds norm(x) to the activation dtype before the weight


QWEN3_NORM = NormStyle(weight_offset=0.0, round_before_weight=True)
ZERO_CENTRED_NORM = NormStyle(weight_offset=1.0, round_before_weight=False)


@dataclass(frozen=True)
class Kernels:
    embedding: Embedding
    rms_norm: RmsNorm
    add_rms_norm: AddRmsNormInplace
    qk_norm_rope_write_kv: QkNormRopeWriteKv  # q/k norm + RoPE and the KV cache write, one launch
    attention: PagedAttention  # prefill steps (any rows per request)
    # Decode steps (one row per request): the q/k norm + RoPE + KV write and DecodeAttention, in one
    # launch where it can.
    decode_rope_attention: DecodeRopeAttention
    gather_kv: GatherKv  # GEMM prefill attention: a request's KV pages -> contiguous scratch
    causal_softmax: CausalSoftmax  # GEMM prefill attention: scores -> probabilities
    chunk_copy: ChunkCopy  # GEMM prefill attention: query rows packed by kv head, outputs back
    flash_attention: FlashAttention  # FlashAttention prefill (compiled on first use: flash plans only)
    packed_gather_kv: PackedGatherKv  # FlashAttention prefill: the step's long chunks' KV pages -> scratch
    output_gate: SigmoidMulInplace
    silu_mul: SiluMul
    gemv: Gemv  # small-batch decode projections with the norm, SwiGLU or residual add fused in
    sample: Sample
    conv1d: CausalConv1d | None = None
    gdn_gates: GdnGates | None = None
    delta_rule: GatedDeltaRule | None = None  # prefill steps (any rows per request)
    delta_rule_decode: GatedDeltaRuleDecode | None = None  # decode steps (one row per request)
    # Prefill steps of at least chunked_delta_rule_min_rows rows (routing.CHUNKED_DELTA_RULE_MIN_ROWS; None: none).
    delta_rule_chunked: ChunkedGatedDeltaRule | None = None
    chunked_delta_rule_min_rows: int | None = None
    gated_norm: GatedRmsNorm | None = None


def build_kernels(geometry: Geometry, activation_dtype: str, norm: NormStyle, num_sms: int, page_size: int,
                  compute_capability: str = "0.0") -> Kernels:
    """Launchers for a model of ``geometry`` in ``activation_dtype`` storage, on a GPU of ``num_sms`` SMs
    and ``compute_capability`` (the plan's hardware: launchers that pick a block shape by the grid's
    blocks an SM, the FlashAttention kernel by routing.warpgroup_flash), over KV pages of ``page_size``
    tokens (the plan's, compiled into the decode attention kernels)."""
    codec = build_codec(activation_dtype)
    # A simulator thread is a Python thread: smaller blocks there (the kernels loop over what a
    # block does not cover), full-size blocks on the GPU.
    simulated = simulator_enabled()
    linear = {}
    if geometry.num_linear_layers:
        delta_rule = GatedDeltaRule(codec, geometry.linear_key_head_dim, **({"dk_split": 1} if simulated else {}))
        linear = dict(
            conv1d=CausalConv1d(codec, geometry.conv_kernel_size),
            gdn_gates=GdnGates(codec, build_codec("float32")),
            delta_rule=delta_rule,
            delta_rule_decode=GatedDeltaRuleDecode(codec, geometry.linear_key_head_dim, delta_rule),
            gated_norm=GatedRmsNorm(codec),
        )
        min_rows = routing.CHUNKED_DELTA_RULE_MIN_ROWS
        if min_rows is not None:
            linear.update(delta_rule_chunked=ChunkedGatedDeltaRule(codec, geometry.linear_key_head_dim, delta_rule),
                          chunked_delta_rule_min_rows=min_rows)
    attention = PagedAttention(codec, geometry.head_dim, geometry.gqa_group, rows_per_tile=PREFILL_ROWS_PER_TILE,
                               threads=32 if simulated else 128)
    qk_norm_rope_write_kv = QkNormRopeWriteKv(codec, norm.round_before_weight)
    return Kernels(
        embedding=Embedding(codec),
        rms_norm=RmsNorm(codec, norm.round_before_weight),
        add_rms_norm=AddRmsNormInplace(codec, norm.round_before_weight),
        qk_norm_rope_write_kv=qk_norm_rope_write_kv,
        attention=attention,
        decode_rope_attention=DecodeRopeAttention(
            qk_norm_rope_write_kv,
            DecodeAttention(codec, geometry.head_dim, geometry.gqa_group, attention, num_sms=num_sms,
                            page_size=page_size),
            norm.round_before_weight, geometry.head_dim, geometry.gqa_group, geometry.rotary_dim),
        gather_kv=GatherKv(),
        causal_softmax=CausalSoftmax(codec),
        chunk_copy=ChunkCopy(),
        flash_attention=(WarpgroupFlashAttention() if routing.warpgroup_flash(compute_capability, geometry.head_dim)
                         else FlashAttention()),
        packed_gather_kv=PackedGatherKv(),
        output_gate=SigmoidMulInplace(codec),
        silu_mul=SiluMul(codec),
        gemv=Gemv(codec, norm.round_before_weight),
        sample=Sample(max_threads=32) if simulated else Sample(),
        **linear,
    )
