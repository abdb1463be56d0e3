"""Bandwidth of the memory-bound row kernels against the card's copy bandwidth (issue 6).

    python3 bench/kernels.py [--rows 16384] [--repeats 50] [--inner 10] [--out FILE]
    python3 bench/kernels.py --smoke      # tiny shapes in the Numba CUDA simulator (a CPU check of the script)

For each kernel (embedding, RMSNorm, fused add + RMSNorm, q/k norm + RoPE,
SiLU-mul, sigmoid gate, residual add) at prefill-sized bf16 shapes, the
delta-rule decode step (64 requests of Qwen3.5-9B's linear heads), Qwen3.5-9B's
causal conv1d (a prefill chunk, and a decode step of 256 requests), decode
attention (64 requests x 4096 cached tokens of Qwen3-8B's heads) and GEMM
prefill attention's causal softmax (the last tile of a 4096-token Qwen3-8B
prompt: 16384 score rows of 4096 keys), it reports
the median GPU time of one launch, the bandwidth it achieves (bytes the
kernel must read plus bytes it must write, over that time), that bandwidth as
a share of the copy bandwidth measured in the same run (torch ``dst.copy_(src)``
of a ``--copy-gib`` buffer: read + write bytes over time), the time of the
scalar kernel (``vectorize=False``; for decode attention the general paged
kernel it falls back to, for the delta-rule decode step delta_rule.py's
general kernel) and of torch's nearest equivalent.

Timing: every case is warmed up (the Numba compile happens there), then
``--inner`` launches are captured in one CUDA graph (``--no-graph``: launched
eagerly) and the graph is replayed ``--repeats`` times between CUDA events; a
launch's time is a replay's time over ``--inner``, and the median is reported.
Numba kernels launch on torch's current stream through
``cuda.external_stream`` (as executor/device.py does), so they are captured.

Prints a markdown table; ``--out FILE`` also appends it to FILE with the
command line, the GPU name and the date.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # `python3 bench/kernels.py` puts bench/ first on the path, not the repo
    sys.path.insert(0, str(ROOT))

EPS = 1e-6
BF16_BYTES = 2
INT32_BYTES = 4
QWEN3_VOCAB = 151936


@dataclass(frozen=True)
class Shapes:
    """The sizes the cases use: real prefill sizes on the GPU, tiny ones under --smoke."""

    rows: int
    hidden: int
    vocab: int
    intermediate: int
    qwen3_heads: int  # Qwen3-8B q: 32 heads of 128, rotary 128
    qwen3_head_dim: int
    qwen3_5_heads: int  # Qwen3.5 q: 16 heads of 256 in a [q | gate] buffer, rotary 64
    qwen3_5_head_dim: int
    qwen3_5_rotary_dim: int
    decode_batch: int  # delta rule: decode rows (one token per request), Qwen3.5-9B's linear heads
    serving_batch: int  # conv1d decode: rows of a serving decode step (max_batch 256), one request each
    linear_key_heads: int
    linear_value_heads: int
    linear_head_dim: int
    qwen3_kv_heads: int  # decode attention: decode_batch requests of decode_context cached tokens
    decode_context: int
    page_size: int
    prompt_tokens: int  # causal softmax: the last GEMM-attention tile of a prompt this long (rows score rows)


def real_shapes(rows: int) -> Shapes:
    return Shapes(rows, 4096, QWEN3_VOCAB, 12288, 32, 128, 16, 256, 64, 64, 256, 16, 32, 128, 8, 4096, 16, 4096)


SMOKE_SHAPES = Shapes(rows=3, hidden=64, vocab=11, intermediate=32, qwen3_heads=2, qwen3_head_dim=16,
                      qwen3_5_heads=2, qwen3_5_head_dim=32, qwen3_5_rotary_dim=16, decode_batch=2, serving_batch=3,
                      linear_key_heads=1, linear_value_heads=2, linear_head_dim=8, qwen3_kv_heads=1,
                      decode_context=8, page_size=4, prompt_tokens=13)


@dataclass(frozen=True)
class Case:
    """One kernel at one shape. Each callable takes the Numba stream to launch on (torch's ignore it)."""

    kernel: str
    shape: str
    bytes_moved: int  # bytes the op must read plus bytes it must write
    vector: bool  # whether our launcher takes the 16-byte vector path for these arrays
    ours: Callable[[Any], None]
    scalar: Callable[[Any], None] | None  # None: the kernel has no separate scalar path
    torch_op: Callable[[Any], None]


@dataclass(frozen=True)
class Row:
    case: Case
    us: float
    scalar_us: float | None
    torch_us: float


class Env:
    """Where the cases run: the executor's ``Device`` (the GPU, or the simulator with ``smoke``), whose
    Numba stream of torch's current stream the launches use."""

    def __init__(self, smoke: bool) -> None:
        import torch

        from bench.common import open_bench_device

        self.smoke = smoke
        self.torch = torch
        self.runtime = open_bench_device(smoke)
        self.device = self.runtime.torch_device

    def stream(self) -> Any:
        """The Numba stream of torch's current stream (0 in the simulator)."""
        return self.runtime.current_stream()

    def randn(self, *shape: int, scale: float = 1.0, shift: float = 0.0) -> Any:
        t = self.torch.randn(*shape, device=self.device) * scale + shift
        return t.to(self.torch.bfloat16)

    def synchronize(self) -> None:
        self.runtime.synchronize()


# ---------------------------------------------------------------- cases


def embedding_case(env: Env, s: Shapes) -> Case:
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.rows.embedding import Embedding

    torch = env.torch
    table = env.randn(s.vocab, s.hidden)
    ids = torch.randint(0, s.vocab, (s.rows,), device=env.device, dtype=torch.int32)
    out = env.randn(s.rows, s.hidden)
    ours, scalar = Embedding(build_codec("bfloat16")), Embedding(build_codec("bfloat16"), vectorize=False)
    args = (ids, table, out, ids[:0])  # no id names a previous step's sample
    ids_long = ids.long()
    return Case(
        "embedding", f"{s.rows} x {s.hidden} of {s.vocab}",
        2 * s.rows * s.hidden * BF16_BYTES + s.rows * INT32_BYTES,
        ours.uses_vector(args[1], args[2]),
        lambda stream: ours(*args, stream=stream),
        lambda stream: scalar(*args, stream=stream),
        lambda stream: torch.index_select(table, 0, ids_long, out=out),
    )


def rms_norm_case(env: Env, s: Shapes) -> Case:
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.rows.norm import RmsNorm

    F = env.torch.nn.functional
    x, w, out = env.randn(s.rows, s.hidden), env.randn(s.hidden, scale=0.1, shift=1.0), env.randn(s.rows, s.hidden)
    ours = RmsNorm(build_codec("bfloat16"), True)
    scalar = RmsNorm(build_codec("bfloat16"), True, vectorize=False)
    args = (x, w, out)
    return Case(
        "rms_norm", f"{s.rows} x {s.hidden}",
        2 * s.rows * s.hidden * BF16_BYTES + s.hidden * BF16_BYTES,
        ours.uses_vector(*args),
        lambda stream: ours(*args, EPS, 0.0, stream=stream),
        lambda stream: scalar(*args, EPS, 0.0, stream=stream),
        lambda stream: F.rms_norm(x, (s.hidden,), w, EPS),
    )


def add_rms_norm_case(env: Env, s: Shapes) -> Case:
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.rows.norm import AddRmsNormInplace

    F = env.torch.nn.functional
    x, residual = env.randn(s.rows, s.hidden), env.randn(s.rows, s.hidden)
    w = env.randn(s.hidden, scale=0.1, shift=1.0)
    ours = AddRmsNormInplace(build_codec("bfloat16"), True)
    scalar = AddRmsNormInplace(build_codec("bfloat16"), True, vectorize=False)
    args = (x, residual, w, x)  # out is x, as the decoder calls it

    def torch_op(stream: Any) -> None:
        residual.add_(x)
        x.copy_(F.rms_norm(residual, (s.hidden,), w, EPS))

    return Case(
        "add_rms_norm (out = x)", f"{s.rows} x {s.hidden}",
        4 * s.rows * s.hidden * BF16_BYTES + s.hidden * BF16_BYTES,  # read x, residual; write residual, out
        ours.uses_vector(*args),
        lambda stream: ours(*args, EPS, 0.0, stream=stream),
        lambda stream: scalar(*args, EPS, 0.0, stream=stream),
        torch_op,
    )


def qk_norm_rope_case(
    env: Env, s: Shapes, heads: int, head_dim: int, rotary_dim: int, zero_centred: bool, strided: bool
) -> Case:
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.rope.qk_norm_rope import QkNormRopeInplace

    torch = env.torch
    F = torch.nn.functional
    theta, offset = (1e7, 1.0) if zero_centred else (1e6, 0.0)
    buf = env.randn(s.rows, heads, 2 * head_dim if strided else head_dim, scale=3.0)
    x = buf[..., :head_dim]  # Qwen3.5's q is the first half of each head's [q | gate]
    w = env.randn(head_dim, scale=0.1, shift=1.0 - offset)
    positions = torch.arange(s.rows, device=env.device, dtype=torch.int32)
    ours = QkNormRopeInplace(build_codec("bfloat16"), not zero_centred)
    scalar = QkNormRopeInplace(build_codec("bfloat16"), not zero_centred, vectorize=False)
    inv_freq = 1.0 / (theta ** (torch.arange(0, rotary_dim, 2, device=env.device).float() / rotary_dim))
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos = torch.cat((angles.cos(), angles.cos()), -1)[:, None, :].to(torch.bfloat16)
    sin = torch.cat((angles.sin(), angles.sin()), -1)[:, None, :].to(torch.bfloat16)
    half = rotary_dim // 2

    def torch_op(stream: Any) -> None:  # HF's q_norm then apply_rotary_pos_emb, written back in place
        n = F.rms_norm(x, (head_dim,), w, EPS)
        rot = n[..., :rotary_dim]
        rotated = torch.cat((-rot[..., half:], rot[..., :half]), -1)
        x[..., :rotary_dim] = rot * cos + rotated * sin
        x[..., rotary_dim:] = n[..., rotary_dim:]

    launch_args = (EPS, offset, rotary_dim, theta)
    name = "qk_norm_rope" + (" (strided q, partial rotary)" if strided else "")
    return Case(
        name, f"{s.rows} x {heads} x {head_dim}, rotary {rotary_dim}",
        2 * s.rows * heads * head_dim * BF16_BYTES + s.rows * INT32_BYTES + head_dim * BF16_BYTES,
        ours.uses_vector(x, w, rotary_dim),
        lambda stream: ours(x, w, positions, *launch_args, stream=stream),
        lambda stream: scalar(x, w, positions, *launch_args, stream=stream),
        torch_op,
    )


def silu_mul_case(env: Env, s: Shapes) -> Case:
    from executor.kernels.rows.activation import SiluMul
    from executor.kernels.primitives.codec import build_codec

    F = env.torch.nn.functional
    gate_up, out = env.randn(s.rows, 2 * s.intermediate, scale=3.0), env.randn(s.rows, s.intermediate)
    ours, scalar = SiluMul(build_codec("bfloat16")), SiluMul(build_codec("bfloat16"), vectorize=False)
    args = (gate_up, out)
    gate, up = gate_up[:, : s.intermediate], gate_up[:, s.intermediate :]
    return Case(
        "silu_mul", f"{s.rows} x 2 x {s.intermediate}",
        3 * s.rows * s.intermediate * BF16_BYTES,
        ours.uses_vector(*args),
        lambda stream: ours(*args, stream=stream),
        lambda stream: scalar(*args, stream=stream),
        lambda stream: out.copy_(F.silu(gate) * up),
    )


def sigmoid_mul_case(env: Env, s: Shapes) -> Case:
    from executor.kernels.rows.output_gate import SigmoidMulInplace
    from executor.kernels.primitives.codec import build_codec

    torch = env.torch
    heads, head_dim = s.qwen3_5_heads, s.qwen3_5_head_dim
    x = env.randn(s.rows, heads, head_dim)
    q_gate = env.randn(s.rows, heads, 2 * head_dim, scale=3.0)
    gate = q_gate[..., head_dim:]  # Qwen3.5's gate: the second half of each head's [q | gate]
    ours = SigmoidMulInplace(build_codec("bfloat16"))
    scalar = SigmoidMulInplace(build_codec("bfloat16"), vectorize=False)
    args = (x, gate)
    return Case(
        "sigmoid_mul (strided gate)", f"{s.rows} x {heads} x {head_dim}",
        3 * s.rows * heads * head_dim * BF16_BYTES,
        ours.uses_vector(*args),
        lambda stream: ours(*args, stream=stream),
        lambda stream: scalar(*args, stream=stream),
        lambda stream: x.mul_(torch.sigmoid(gate)),
    )


def residual_case(env: Env, s: Shapes) -> Case:
    from executor.kernels.primitives.codec import build_codec
    from tests.kernels.add_inplace import AddInplace

    acc, x = env.randn(s.rows, s.hidden), env.randn(s.rows, s.hidden, scale=1e-3)
    ours, scalar = AddInplace(build_codec("bfloat16")), AddInplace(build_codec("bfloat16"), vectorize=False)
    args = (acc, x)
    return Case(
        "residual add", f"{s.rows} x {s.hidden}",
        3 * s.rows * s.hidden * BF16_BYTES,
        ours.uses_vector(*args),
        lambda stream: ours(*args, stream=stream),
        lambda stream: scalar(*args, stream=stream),
        lambda stream: acc.add_(x),
    )


def causal_softmax_case(env: Env, s: Shapes) -> Case:
    """GEMM prefill attention's causal softmax on the last tile of a ``prompt_tokens`` prompt of
    Qwen3-8B's heads: ``rows`` float32 score rows (kv head, query row, group member) of
    ``prompt_tokens`` keys in, bf16 probabilities out. Bytes: the visible scores read, every
    probability written. torch's nearest equivalent (no mask): softmax of the scaled scores."""
    from executor.kernels.attention.causal_softmax import CausalSoftmax
    from executor.kernels.primitives.codec import build_codec

    torch = env.torch
    group = s.qwen3_heads // s.qwen3_kv_heads
    rows_per_head = max(1, s.rows // (s.qwen3_kv_heads * group))
    rows, keys = s.qwen3_kv_heads * rows_per_head * group, s.prompt_tokens
    first_position = keys - rows_per_head
    scores = torch.randn(rows, keys, device=env.device) * 4
    probs = torch.empty(rows, keys, device=env.device, dtype=torch.bfloat16)
    scale = s.qwen3_head_dim ** -0.5
    ours = CausalSoftmax(build_codec("bfloat16"))
    visible_scores = s.qwen3_kv_heads * group * sum(first_position + t + 1 for t in range(rows_per_head))
    return Case(
        "causal_softmax", f"{rows} x {keys}, {rows_per_head} query rows x {group}",
        visible_scores * 4 + rows * keys * BF16_BYTES,
        ours.uses_vector(scores, probs),
        lambda stream: ours(scores, probs, rows_per_head, first_position, scale, group=group, stream=stream),
        None,
        lambda stream: probs.copy_(torch.softmax(scores * scale, dim=-1)),
    )


def delta_rule_decode_case(env: Env, s: Shapes) -> Case:
    """One decode step of the gated delta rule: B requests x Hv heads, each reading and writing its
    float32 state [dk, dv]; bytes = that state traffic plus the qkv row read and the output written.
    Ours is the decode kernel (delta_rule_decode.py); "scalar" is the general kernel it falls back to
    (delta_rule.py, which also runs prefill)."""
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.linear_attention.delta_rule import GatedDeltaRule
    from executor.kernels.linear_attention.delta_rule_decode import GatedDeltaRuleDecode

    torch = env.torch
    b, hk, hv, d = s.decode_batch, s.linear_key_heads, s.linear_value_heads, s.linear_head_dim
    qkv = env.randn(b, 2 * hk * d + hv * d)
    g = -torch.rand(b, hv, device=env.device)
    beta = torch.rand(b, hv, device=env.device)
    state = torch.randn(b, hv, d, d, device=env.device) * 0.1
    q_indptr = torch.arange(b + 1, dtype=torch.int32, device=env.device)
    slots = torch.arange(b, dtype=torch.int32, device=env.device)
    out = env.randn(b, hv, d)
    codec = build_codec("bfloat16")
    general = GatedDeltaRule(codec, d, **({"dk_split": 1} if env.smoke else {}))
    ours = GatedDeltaRuleDecode(codec, d, general)
    args = (qkv, g, beta, state, q_indptr, slots, out)
    repeat = hv // hk

    def torch_op(stream: Any) -> None:  # the same recurrence step in torch (HF's recurrent form)
        q = torch.nn.functional.normalize(qkv[:, : hk * d].view(b, hk, d).float(), dim=-1) * d ** -0.5
        k = torch.nn.functional.normalize(qkv[:, hk * d : 2 * hk * d].view(b, hk, d).float(), dim=-1)
        q, k = q.repeat_interleave(repeat, 1), k.repeat_interleave(repeat, 1)
        v = qkv[:, 2 * hk * d :].view(b, hv, d).float()
        state.mul_(g.exp()[..., None, None])
        delta = beta[..., None] * (v - torch.einsum("bhkv,bhk->bhv", state, k))
        state.add_(k[..., :, None] * delta[..., None, :])
        out.copy_(torch.einsum("bhkv,bhk->bhv", state, q))

    state_bytes = 2 * b * hv * d * d * 4
    return Case(
        "delta_rule decode", f"{b} x {hv} x {d} x {d} (f32 state)",
        state_bytes + b * qkv.shape[1] * BF16_BYTES + b * hv * d * BF16_BYTES + 2 * b * hv * 4,
        ours.uses_vector(state),
        lambda stream: ours(*args, stream=stream),
        lambda stream: general(*args, stream=stream),
        torch_op,
    )


def decode_attention_case(env: Env, s: Shapes) -> Case:
    """Decode attention of B requests over C cached tokens each (Qwen3-8B's heads), pages shuffled; bytes
    = the K and V rows read plus q read and out written. "scalar" is the general paged kernel (the
    fallback), torch's op SDPA over the same keys laid out contiguously (no page table)."""
    from executor.kernels.attention.paged import PagedAttention
    from executor.tiles import plan_tiles
    from executor.kernels.primitives.codec import build_codec
    from executor.kernels.attention.decode import DecodeAttention

    torch = env.torch
    b, c, page = s.decode_batch, s.decode_context, s.page_size
    hq, hkv, d = s.qwen3_heads, s.qwen3_kv_heads, s.qwen3_head_dim
    pages_per_request = -(-c // page)
    num_pages = 1 + b * pages_per_request
    k_cache, v_cache = env.randn(num_pages, page, hkv, d), env.randn(num_pages, page, hkv, d)
    q, out = env.randn(b, hq, d), env.randn(b, hq, d)
    order = torch.randperm(num_pages - 1, generator=torch.Generator().manual_seed(0)) + 1  # page 0 is padding
    as_int32 = lambda values: torch.as_tensor(values, dtype=torch.int32, device=env.device)  # noqa: E731
    q_indptr, kv_lens = list(range(b + 1)), [c] * b
    tiles = [as_int32(a) for a in plan_tiles(q_indptr, kv_lens)]  # B x Hkv blocks: no kv split
    meta = (as_int32(order), as_int32([r * pages_per_request for r in range(b + 1)]),
            as_int32([c - (pages_per_request - 1) * page] * b), as_int32(q_indptr), as_int32(range(b)),
            as_int32([c - 1] * b), *tiles, torch.tensor([b], dtype=torch.uint32, device=env.device))
    codec = build_codec("bfloat16")
    general = PagedAttention(codec, d, hq // hkv, **({"threads": 32} if env.smoke else {}))
    num_sms = None if env.smoke else torch.cuda.get_device_properties(0).multi_processor_count
    ours = DecodeAttention(codec, d, hq // hkv, general, num_sms=num_sms)  # the shape a decode step's grid gets
    bits = lambda x: x.view(torch.int16)  # noqa: E731
    args = (bits(q), bits(k_cache), bits(v_cache), *meta, bits(out), d ** -0.5)
    pages = order.to(env.device).long().view(b, pages_per_request)
    keys = k_cache[pages].flatten(1, 2)[:, :c].transpose(1, 2).contiguous()  # [B, Hkv, C, D]
    values = v_cache[pages].flatten(1, 2)[:, :c].transpose(1, 2).contiguous()
    F = torch.nn.functional
    return Case(
        "decode attention", f"{b} x {c} tokens x {hkv} kv heads x {d} (G {hq // hkv})",
        2 * b * c * hkv * d * BF16_BYTES + 2 * b * hq * d * BF16_BYTES,
        ours.uses_vector(k_cache, v_cache),
        lambda stream: ours(*args, stream=stream),
        lambda stream: general(*args, stream=stream),
        lambda stream: F.scaled_dot_product_attention(q[:, :, None], keys, values, enable_gqa=True),
    )


def conv1d_cases(env: Env, s: Shapes, decode: bool) -> Case:
    """Qwen3.5-9B's causal conv1d + SiLU (K 4 over conv_dim = 2 Hk dk + Hv dv channels): a prefill chunk of
    ``rows`` tokens of one request, or a decode step of ``serving_batch`` requests of a row each. Bytes:
    x read and out written, plus each request's conv state read and written (K - 1 inputs a channel),
    which is a decode step's most. torch's nearest equivalent: a grouped ``F.conv1d`` over the chunk, or
    the state's update written out (HF's ``causal_conv1d_update`` fallback). Decode runs
    ``CausalConv1d.decode`` (the decode build); its "scalar" is the general build it falls back to, at
    CONV1D_DECODE_ROWS_PER_TILE rows a tile."""
    from executor.kernels.linear_attention.conv1d import CausalConv1d
    from executor.kernels.primitives.codec import build_codec
    from executor.routing import CONV1D_DECODE_ROWS_PER_TILE, CONV1D_PREFILL_ROWS_PER_TILE

    torch = env.torch
    F = torch.nn.functional
    taps = 4
    channels = (2 * s.linear_key_heads + s.linear_value_heads) * s.linear_head_dim
    requests, rows = (s.serving_batch, s.serving_batch) if decode else (1, s.rows)
    x, out = env.randn(rows, channels), env.randn(rows, channels)
    weight = env.randn(channels, taps, scale=0.5)
    conv_state = env.randn(requests, channels, taps - 1)
    q_indptr = torch.tensor([0, rows] if not decode else list(range(rows + 1)), dtype=torch.int32, device=env.device)
    slots = torch.arange(requests, dtype=torch.int32, device=env.device)
    ours = CausalConv1d(build_codec("bfloat16"),
                        rows_per_tile=CONV1D_DECODE_ROWS_PER_TILE if decode else CONV1D_PREFILL_ROWS_PER_TILE)
    args = (x, weight, conv_state, q_indptr, slots, out)

    def torch_op(stream: Any) -> None:
        if decode:
            full = torch.cat([conv_state, x[:, :, None]], dim=2)  # [B, C, K]
            out.copy_(F.silu((full * weight).sum(-1)))
            conv_state.copy_(full[:, :, 1:])
        else:
            conv = F.conv1d(x.T[None], weight[:, None, :], padding=taps - 1, groups=channels)[0, :, :rows]
            out.copy_(F.silu(conv).T)

    bytes_moved = 2 * rows * channels * BF16_BYTES + 2 * requests * channels * (taps - 1) * BF16_BYTES
    return Case(
        "conv1d " + ("decode" if decode else "prefill"),
        f"{requests} x {rows // requests} x {channels}",
        bytes_moved,
        ours.decode_views(x, weight, conv_state, out) is not None if decode else ours.uses_vector(x, out),
        (lambda stream: ours.decode(*args, stream=stream)) if decode else (lambda stream: ours(*args, stream=stream)),
        (lambda stream: ours(*args, stream=stream)) if decode else None,
        torch_op,
    )


CASE_BUILDERS: dict[str, Callable[[Env, Shapes], Case]] = {
    "embedding": embedding_case,
    "rms_norm": rms_norm_case,
    "add_rms_norm": add_rms_norm_case,
    "qk_norm_rope": lambda env, s: qk_norm_rope_case(env, s, s.qwen3_heads, s.qwen3_head_dim, s.qwen3_head_dim,
                                                     zero_centred=False, strided=False),
    "qk_norm_rope_strided": lambda env, s: qk_norm_rope_case(env, s, s.qwen3_5_heads, s.qwen3_5_head_dim,
                                                             s.qwen3_5_rotary_dim, zero_centred=True, strided=True),
    "silu_mul": silu_mul_case,
    "sigmoid_mul": sigmoid_mul_case,
    "residual": residual_case,
    "delta_rule_decode": delta_rule_decode_case,
    "conv1d_prefill": lambda env, s: conv1d_cases(env, s, decode=False),
    "conv1d_decode": lambda env, s: conv1d_cases(env, s, decode=True),
    "decode_attention": decode_attention_case,
    "causal_softmax": causal_softmax_case,
}


# ---------------------------------------------------------------- timing


def time_us(env: Env, op: Callable[[Any], None], inner: int, repeats: int, graph: bool) -> float:
    """Median time of one ``op`` launch in microseconds (see the module docstring)."""
    op(env.stream())  # warm-up: compiles the Numba kernel, initialises torch's kernels
    env.synchronize()
    if env.smoke:  # the simulator: wall time of one launch (the script's logic, not a measurement)
        start = time.perf_counter()
        op(0)
        return (time.perf_counter() - start) * 1e6
    torch = env.torch
    if graph:
        cuda_graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(cuda_graph):
            stream = env.stream()  # the capture stream
            for _ in range(inner):
                op(stream)
        replay = cuda_graph.replay
    else:

        def replay() -> None:
            stream = env.stream()
            for _ in range(inner):
                op(stream)

    from bench.common import event_median_us

    replay()
    return event_median_us(replay, repeats, calls_per_fn=inner)


def copy_bandwidth(env: Env, gib: float, inner: int, repeats: int, graph: bool) -> tuple[float, int]:
    """(bytes/s, buffer bytes) of torch ``dst.copy_(src)``: read + write bytes over time.

    On the GPU this is bench/common.py's measurement (bf16, launched eagerly), the denominator the
    decode roofline uses too: a uint8 copy recorded in a CUDA graph measured 2.7 TB/s on the H200
    where the eager bf16 copy measured 4.1-4.2 TB/s, which put the kernels above 100%.
    """
    buffer_bytes = 4096 if env.smoke else int(gib * 2**30)
    if env.smoke:
        torch = env.torch
        src = torch.empty(buffer_bytes, dtype=torch.uint8, device=env.device).random_()
        dst = torch.empty_like(src)
        us = time_us(env, lambda stream: dst.copy_(src), inner, repeats, graph)
        return 2 * buffer_bytes / (us * 1e-6), buffer_bytes
    from bench.common import copy_bandwidth_bytes_per_s

    return copy_bandwidth_bytes_per_s(env.device, buffer_bytes, repeats=repeats), buffer_bytes


# ---------------------------------------------------------------- report


def table(rows: list[Row], copy_bytes_per_s: float) -> str:
    lines = [
        "| kernel | shape | path | us | GB/s | % of copy BW | scalar us | torch us |",
        "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: |",
    ]
    for row in rows:
        bandwidth = row.case.bytes_moved / (row.us * 1e-6)
        scalar = f"{row.scalar_us:.1f}" if row.scalar_us is not None else "-"
        lines.append(
            f"| {row.case.kernel} | {row.case.shape} | {'vector' if row.case.vector else 'scalar'} | {row.us:.1f}"
            f" | {bandwidth / 1e9:.0f} | {100 * bandwidth / copy_bytes_per_s:.0f}% | {scalar} | {row.torch_us:.1f} |"
        )
    return "\n".join(lines)


def timing_note(args: argparse.Namespace, graph: bool) -> str:
    if args.smoke:
        return "wall time of one launch in the simulator (checks the script, measures nothing)"
    return f"{'CUDA graph' if graph else 'eager'} timing, median of {args.repeats} replays of {args.inner} launches"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=16384, help="token rows (default 16384)")
    parser.add_argument("--repeats", type=int, default=50, help="timed graph replays per case (median)")
    parser.add_argument("--inner", type=int, default=10, help="launches per graph replay")
    parser.add_argument("--copy-gib", type=float, default=2.0, help="size of the copy-bandwidth buffer, GiB")
    parser.add_argument("--kernels", default=",".join(CASE_BUILDERS), help="comma-separated subset of: "
                        + ", ".join(CASE_BUILDERS))
    parser.add_argument("--no-graph", action="store_true", help="launch eagerly instead of replaying a CUDA graph")
    parser.add_argument("--no-scalar", action="store_true", help="skip timing the scalar kernels")
    parser.add_argument("--out", type=Path, help="append the table, command line, GPU and date to this file")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes in the Numba CUDA simulator (CPU)")
    args = parser.parse_args(argv)
    unknown = set(args.kernels.split(",")) - set(CASE_BUILDERS)
    if unknown:
        parser.error(f"unknown kernels {sorted(unknown)}; choose from {list(CASE_BUILDERS)}")
    return args


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    os.environ.setdefault("NUMBA_CUDA_LOW_OCCUPANCY_WARNINGS", "0")
    from executor.device import DeviceError

    try:
        env = Env(args.smoke)  # --smoke: the simulator, set up by open_device
    except DeviceError as error:
        sys.exit(f"{error} (here: pass --smoke for the simulator)")
    env.torch.manual_seed(0)
    graph = not args.no_graph
    shapes = SMOKE_SHAPES if args.smoke else real_shapes(args.rows)
    copy_bytes_per_s, copy_bytes = copy_bandwidth(env, args.copy_gib, args.inner, args.repeats, graph)
    print(f"copy bandwidth: {copy_bytes_per_s / 1e9:.0f} GB/s (dst.copy_(src) of {copy_bytes / 2**30:.2f} GiB,"
          " read + write)", file=sys.stderr)
    rows = []
    for name in args.kernels.split(","):
        case = CASE_BUILDERS[name](env, shapes)
        us = time_us(env, case.ours, args.inner, args.repeats, graph)
        scalar_us = None if args.no_scalar or case.scalar is None else time_us(env, case.scalar, args.inner, args.repeats, graph)
        torch_us = time_us(env, case.torch_op, args.inner, args.repeats, graph)
        rows.append(Row(case, us, scalar_us, torch_us))
        print(f"{case.kernel}: {us:.1f} us", file=sys.stderr)
        env.synchronize()
    report = table(rows, copy_bytes_per_s)
    copy_line = f"copy bandwidth {copy_bytes_per_s / 1e9:.0f} GB/s ({copy_bytes / 2**30:.2f} GiB dst.copy_(src))"
    print(report)
    print(f"\n{copy_line}")
    if args.out is not None:
        gpu = "Numba CUDA simulator" if args.smoke else env.torch.cuda.get_device_name()
        command = shlex.join([sys.executable, *sys.argv])
        stamp = datetime.datetime.now().astimezone().isoformat(timespec="seconds")
        with args.out.open("a") as f:
            f.write(f"\n## bench/kernels.py, {stamp}\n\n`{command}`\n\nGPU: {gpu}; {copy_line}; "
                    f"{timing_note(args, graph)}\n\n{report}\n")


if __name__ == "__main__":
    main()
