"""Small-batch decode projections on tensor cores: gemv.py's three fused kernels for 1..8 rows.

gemv.py's kernels multiply on CUDA cores: each weight element costs a fused multiply-add per
batch row, and at batch 4 they spilled and lost to cuBLAS. Here a warp feeds 16 weight rows
straight from global memory into ``mma.sync.m16n8k16`` (mma.py) as the A operand, with the batch
as the 8 columns of B, so 1 and 8 rows cost the same instructions and the kernel streams
weights at any batch up to 8:

- ``norm_project``: ``out [B, N] = RMSNorm(hidden) @ W^T``;
- ``norm_swiglu``: ``act [B, I] = swiglu(normed @ W_gate^T, normed @ W_up^T)`` (``gate_up [2I, K]``);
- ``project_add``: ``hidden [B, N] += x @ W^T`` in place.

Roundings as gemv.py: RMSNorm(hidden) is rounded to bf16 before the product (norm.py's style),
each projection is rounded once, SwiGLU and the residual add as activation.py and the add +
RMSNorm kernel do. Accumulation is float32 in the tensor core's order.

Layout. A block owns a 16-row tile of the output (two for SWIGLU: gate rows n.., up rows I + n..)
and splits K over its ``warps`` warps. A "unit" is 32 columns: lane (g, t) (g = lane // 4,
t = lane % 4) loads the 16-byte chunk ``t`` of the unit from rows g and g + 8, so a warp load
is 8 rows x 64 contiguous bytes, and the chunk's four words are the A registers of the unit's two
k-steps. The dot product does not care which physical column plays which k of the tile, as long
as A and B agree: lane (g, t) also gives B the same chunk of batch row g (zero past the batch).
Warp w takes units w, w + warps, ...; ``units_per_trip`` of them have their loads in flight
before any is used. The warps' partial tiles meet in shared memory, where warp 0 adds them in
warp order and runs the epilogue (C fragment: lane (g, t) holds rows g and g + 8 of batch
columns 2t and 2t + 1). For ``normed`` kernels the block first computes each batch row's
1 / rms (one block sum a row); a lane then normalizes its B chunk as it loads it.

bf16 only (a float32 model keeps gemv.py's kernels). K must be a whole number of units and N of
16-row tiles (the launcher checks).
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from executor.kernels.activation import build_swiglu
from executor.kernels.codec import build_codec
from executor.kernels.gemv import RESIDUAL, STORE, SWIGLU
from executor.kernels.launch import WARP_THREADS, Kernel, multiprocessor_count
from executor.kernels.mma import build_mma_bf16
from executor.kernels.norm import build_normalize, inv_rms_from_sum
from executor.kernels.reduce import block_sum
from executor.kernels.vector import VECTOR_WORDS, build_lanes, build_vector_access, vector_aligned
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

MAX_BATCH = 8  # B's columns
TILE_ROWS = 16  # A's rows
UNIT_COLUMNS = 32  # 4 lanes x one 16-byte chunk of 8 bf16
UNITS_PER_TRIP = 4  # a lane's loads in flight: 4 units x 2 rows x 16 bytes (2 units for SWIGLU's two tiles); 8 spilled at 128 registers
#: Warps an SM keeps (the launch bound: 128 registers a thread).
WARPS_PER_SM = 16
MAX_SPLIT = 8  # warps a block splits K over


def split_warps(row_tiles: int, units: int, num_sms: int) -> int:
    """Warps a block (K split that many ways): the largest power of two <= MAX_SPLIT that leaves
    every tile's block resident at once (tiles x warps <= WARPS_PER_SM x SMs), and no warp without a
    unit. Qwen3-8B on 132 SMs: qkv 384 tiles -> 4, o_proj and down 256 -> 8, gate_up 768 -> 2."""
    warps = 1
    while warps < MAX_SPLIT and row_tiles * warps * 2 <= WARPS_PER_SM * num_sms and units >= warps * 2:
        warps *= 2
    return warps


def build_gemv_mma_kernel(batch: int, in_features: int, epilogue: str, *, normed: bool, round_before_weight: bool,
                          warps: int, units_per_trip: int) -> Callable[..., Any]:
    """Kernel ``(x [B, K], norm_weight [K], weight [N, K], out, eps f32, weight_offset f32)``, bf16 as int16
    bits, B = ``batch`` <= 8, K = ``in_features`` (whole units), out as gemv.py's (``[B, N]``, or
    ``[B, N / 2]`` for SWIGLU). Blocks of ``warps`` warps, any grid (grid-stride over 16-row tiles),
    ``shared_bytes(batch, warps, epilogue)`` of dynamic shared memory.
    """
    codec = build_codec("bfloat16")
    load, store = codec.load, codec.store
    get_lane, put_lane = build_lanes(codec)
    load_vector, _ = build_vector_access()
    mma = build_mma_bf16()
    normalize = build_normalize(codec, round_before_weight)
    swiglu = build_swiglu(codec)
    threads = warps * WARP_THREADS
    tiles = 2 if epilogue == SWIGLU else 1  # A tiles a warp multiplies: gate and up
    units = in_features // UNIT_COLUMNS
    trips = -(-units // (warps * units_per_trip))
    whole_trips = units % (warps * units_per_trip) == 0
    chunks = in_features // 8  # the prologue's 16-byte chunks of a row
    stage_chunks = -(-chunks // threads)
    words_a = units_per_trip * tiles * 2 * VECTOR_WORDS
    acc_values = 4 * tiles  # C fragments: four float32 a lane a tile
    partial_at = batch  # shared: 1 / rms per batch row, then the warps' partial tiles, then block_sum's scratch
    scratch_at = partial_at + warps * tiles * 4 * WARP_THREADS
    options = {} if simulator_enabled() else {"launch_bounds": (threads, WARPS_PER_SM // warps)}

    @cuda.jit(device=True, inline=True)
    def stage_inv_rms(x, shared, eps):
        """shared[b] <- 1 / rms(x[b]) for every batch row, by the whole block."""
        tid = cuda.threadIdx.x
        words = cuda.local.array(VECTOR_WORDS, int32)
        for b in range(batch):
            partial = float32(0.0)
            for k in range(stage_chunks):
                c = tid + k * threads
                if c < chunks:
                    load_vector(x, (b, c * 8), words, 0)
                    for j in range(8):
                        v = load(get_lane(words, j))
                        partial += v * v
            total = block_sum(shared[scratch_at:], partial)
            if tid == 0:
                shared[b] = inv_rms_from_sum(total, in_features, eps)
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def load_b(x, norm_weight, shared, g, col, weight_offset, b_words, n_words):
        """B's chunk for batch row g at column col: x's words, or RMSNorm(x)'s rounded to bf16; zero past the batch."""
        if g < batch:
            load_vector(x, (g, col), b_words, 0)
            if normed:
                load_vector(norm_weight, (col,), n_words, 0)
                for j in range(8):
                    value = normalize(load(get_lane(b_words, j)), shared[g], load(get_lane(n_words, j)), weight_offset)
                    put_lane(b_words, j, store(value))
        else:
            for w in range(VECTOR_WORDS):
                b_words[w] = 0

    @cuda.jit(**options)
    def gemv_mma(x, norm_weight, weight, out, eps, weight_offset):
        shared = cuda.shared.array(0, float32)
        tid = cuda.threadIdx.x
        warp, lane = tid // WARP_THREADS, tid % WARP_THREADS
        g, t = lane // 4, lane % 4
        if normed:
            stage_inv_rms(x, shared, eps)
        a_words = cuda.local.array(words_a, int32)
        b_words = cuda.local.array(VECTOR_WORDS, int32)
        n_words = cuda.local.array(VECTOR_WORDS, int32)
        acc = cuda.local.array(acc_values, float32)
        row_tiles = out.shape[1] // TILE_ROWS
        second = weight.shape[0] // 2  # SWIGLU: up row of gate row n is n + I
        for tile in range(cuda.blockIdx.x, row_tiles, cuda.gridDim.x):
            row0 = tile * TILE_ROWS
            for i in range(4 * tiles):
                acc[i] = float32(0.0)
            for trip in range(trips):
                for u in range(units_per_trip):
                    unit = (trip * units_per_trip + u) * warps + warp
                    if whole_trips or unit < units:
                        col = unit * UNIT_COLUMNS + t * 8
                        for r in range(tiles):
                            at = (u * tiles + r) * 2 * VECTOR_WORDS
                            load_vector(weight, (row0 + r * second + g, col), a_words, at)
                            load_vector(weight, (row0 + r * second + g + 8, col), a_words, at + VECTOR_WORDS)
                    else:  # every lane runs every mma (the simulator's emulation has barriers)
                        for w in range(tiles * 2 * VECTOR_WORDS):
                            a_words[u * tiles * 2 * VECTOR_WORDS + w] = 0
                for u in range(units_per_trip):
                    unit = (trip * units_per_trip + u) * warps + warp
                    if whole_trips or unit < units:
                        load_b(x, norm_weight, shared, g, unit * UNIT_COLUMNS + t * 8, weight_offset, b_words, n_words)
                    else:  # zero A, and B zero too: a stale B word could hold NaN bits (0 x NaN)
                        for w in range(VECTOR_WORDS):
                            b_words[w] = 0
                    for r in range(tiles):
                        at = (u * tiles + r) * 2 * VECTOR_WORDS
                        for s in range(2):  # the chunk's words 2s, 2s + 1: one k-step
                            acc[4 * r], acc[4 * r + 1], acc[4 * r + 2], acc[4 * r + 3] = mma(
                                a_words[at + 2 * s], a_words[at + VECTOR_WORDS + 2 * s],
                                a_words[at + 2 * s + 1], a_words[at + VECTOR_WORDS + 2 * s + 1],
                                b_words[2 * s], b_words[2 * s + 1],
                                acc[4 * r], acc[4 * r + 1], acc[4 * r + 2], acc[4 * r + 3])
            for i in range(4 * tiles):
                shared[partial_at + (warp * 4 * tiles + i) * WARP_THREADS + lane] = acc[i]
            cuda.syncthreads()
            if warp == 0:
                for i in range(4 * tiles):
                    total = float32(0.0)
                    for w in range(warps):
                        total += shared[partial_at + (w * 4 * tiles + i) * WARP_THREADS + lane]
                    acc[i] = total
                for i in range(4):
                    n = row0 + g + 8 * (i // 2)
                    b = 2 * t + i % 2
                    if b < batch:
                        if epilogue == SWIGLU:
                            out[b, n] = swiglu(store(acc[i]), store(acc[4 + i]))
                        elif epilogue == RESIDUAL:
                            out[b, n] = store(load(out[b, n]) + load(store(acc[i])))
                        else:
                            out[b, n] = store(acc[i])
            cuda.syncthreads()  # warp 0 has read the partials before the next tile's overwrite them

    return gemv_mma


def shared_bytes(batch: int, warps: int, epilogue: str) -> int:
    """Dynamic shared memory of a block: 1 / rms per batch row, the warps' partial tiles, block_sum's scratch."""
    tiles = 2 if epilogue == SWIGLU else 1
    return 4 * (batch + warps * tiles * 4 * WARP_THREADS + warps * WARP_THREADS)


class GemvMma:
    """Launchers of the three fused projections on tensor cores (module docstring), gemv.Gemv's interface.

    Kernels compile per (epilogue, batch, K, warps) on first use (the eager warm-up before graph
    capture). Arguments are the plan's contiguous, 16-byte-aligned bf16 views (int16 bits); a shape
    or alignment mismatch is the caller's bug and raises ValueError with the shapes.
    """

    def __init__(self, round_before_weight: bool, units_per_trip: int = UNITS_PER_TRIP,
                 warps: int | None = None) -> None:
        self.round_before_weight = round_before_weight
        self.units_per_trip = units_per_trip
        self.warps = warps  # None: split_warps per shape
        self.num_sms = multiprocessor_count()
        self._kernels: dict[tuple[str, int, int, bool, int], Kernel] = {}

    def norm_project(self, hidden: Any, norm_weight: Any, eps: float, weight_offset: float, weight: Any, out: Any,
                     stream: Any = 0) -> None:
        """``out [B, N] = RMSNorm(hidden [B, K]) @ weight [N, K]^T``."""
        self._launch(STORE, True, hidden, norm_weight, weight, out, eps, weight_offset, stream)

    def norm_swiglu(self, hidden: Any, norm_weight: Any, eps: float, weight_offset: float, gate_up_weight: Any,
                    act: Any, stream: Any = 0) -> None:
        """``act [B, I] = swiglu(normed @ gate^T, normed @ up^T)``, gate_up_weight [2 I, K] (gate rows first)."""
        self._launch(SWIGLU, True, hidden, norm_weight, gate_up_weight, act, eps, weight_offset, stream)

    def project_add(self, x: Any, weight: Any, hidden: Any, stream: Any = 0) -> None:
        """``hidden [B, N] += x [B, K] @ weight [N, K]^T`` (in place)."""
        self._launch(RESIDUAL, False, x, weight, weight, hidden, 1.0, 0.0, stream)

    def _launch(self, epilogue: str, normed: bool, x: Any, norm_weight: Any, weight: Any, out: Any, eps: float,
                weight_offset: float, stream: Any) -> None:
        batch, in_features = (int(n) for n in x.shape)
        out_rows = int(weight.shape[0]) // (2 if epilogue == SWIGLU else 1)
        if (int(weight.shape[1]) != in_features or tuple(out.shape) != (batch, out_rows) or not 1 <= batch <= MAX_BATCH
                or in_features % UNIT_COLUMNS or out_rows % TILE_ROWS):
            raise ValueError(f"gemv_mma {epilogue}: x {tuple(x.shape)}, weight {tuple(weight.shape)}, out "
                             f"{tuple(out.shape)}: need 1..{MAX_BATCH} rows, K a multiple of {UNIT_COLUMNS} and "
                             f"output rows a multiple of {TILE_ROWS}")
        if not vector_aligned(x, norm_weight, weight):
            raise ValueError(f"gemv_mma {epilogue}: x, norm_weight and weight rows must be whole 16-byte-aligned chunks")
        row_tiles = out_rows // TILE_ROWS
        warps = self.warps or split_warps(row_tiles, in_features // UNIT_COLUMNS, self.num_sms)
        key = (epilogue, batch, in_features, normed, warps)
        kernel = self._kernels.get(key)
        if kernel is None:
            units_per_trip = self.units_per_trip // (2 if epilogue == SWIGLU else 1) or 1
            kernel = self._kernels[key] = Kernel(build_gemv_mma_kernel(
                batch, in_features, epilogue, normed=normed, round_before_weight=self.round_before_weight,
                warps=warps, units_per_trip=units_per_trip))
        grid = max(1, min(row_tiles, self.num_sms * (WARPS_PER_SM // warps)))
        kernel[grid, warps * WARP_THREADS, stream, shared_bytes(batch, warps, epilogue)](
            x, norm_weight, weight, out, np.float32(eps), np.float32(weight_offset))
