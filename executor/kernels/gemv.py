"""Small-batch decode projections as GEMVs, with the row kernels around them fused in.

At batch 1 a decode projection reads every weight once for two flops: it streams weights. cuBLAS
runs Qwen3-8B's at 2.6-4.2 TB/s on the H200 (o_proj 13.1 us for 33.5 MB), and the RMSNorm before
qkv and gate_up, SwiGLU after gate_up and the residual add after o_proj and down each cost a
launch of their own (4.1 us for an add + RMSNorm of one row). Three kernels here replace the
pairs:

- ``norm_project``: ``out [B, N] = normed(hidden) @ W^T``. The block's prologue writes RMSNorm(hidden)
  (rows/norm.py's rounding, NormStyle's weight) into shared memory as float32, once per block.
- ``norm_swiglu``: ``act [B, I] = swiglu(normed @ W_gate^T, normed @ W_up^T)`` for the fused
  ``gate_up [2I, K]`` weight: a warp owns gate row n and up row I + n, so the SwiGLU is its epilogue
  (rows/activation.py's rounding: each projection rounded, then ``round(silu(gate)) * up``).
- ``project_add``: ``hidden [B, N] += x @ W^T`` in place, rounding as the add + RMSNorm kernel does:
  ``round(hidden + round(acc))``.

Layout. A row team (a warp on the GPU; 4 lanes in the simulator, whose run time grows much faster
than a thread's work) owns ``rows`` weight rows and walks K in 16-byte chunks
(primitives/vector.py): lane l takes chunks l, l + 32, ..., so each warp load is 512 contiguous
bytes of a row, ``chunks_per_lane`` chunks of each row in flight before the multiply-adds against
x's matching chunk (from global memory, where the block's warps share it through L1, or from the
staged shared copy, 16 bytes a load). Then a shuffle tree sums the lanes and lane 0 runs the
epilogue. Blocks of GEMV_WARPS warps walk row groups grid-stride; the launcher sizes the grid at
``blocks_per_sm`` blocks an SM, which the launch bounds also give ptxas (so a prologue runs once per
block). Every output element belongs to one team, so ``project_add``'s in-place update has no race.
Accumulation is float32 in chunk order, not cuBLAS's order: outputs differ from the GEMM path's by
float32 rounding of the sums.

Why these shapes (on the H200, CUDA-graph timing over distinct weight copies, so L2 holds none;
docs/benchmarks.md, "GEMV shapes" and "GEMV prologue"):

- One row a warp, 8 chunks a lane, 4 warps a block, 4 blocks an SM (94 registers): a plain GEMV at
  batch 1 took qkv 6144 x 4096 14.0 us (cuBLAS 15.4), o_proj 4096 x 4096 9.8 (13.1), gate_up
  24576 x 4096 47.6 (48.3), down 4096 x 12288 25.0 (28.6); two rows x 4 chunks ran within 0.5 us of
  it. At batch 4 the same kernels were slower than cuBLAS on three of the four shapes (122
  registers), so the plan keeps them to small batches (capacity ``decode_gemv_batch``).
- The prologue's loads all go out before any is used (a thread's hidden and norm-weight chunks: one
  memory round trip a row); loading and using a chunk at a time, qkv took 18.2 us and gate_up 51.0
  against 16.4 and 49.3.
- The normed kernels load their first row group's first trip of weights before the RMSNorm
  prologue, which then runs under that latency, and give a warp two rows, n and n + N / 2, with 8
  chunks of each in flight: 8 KB a warp (128 registers, the launch bound's limit at 4 x 4). In the
  batch-1 Qwen3-8B decode graph gate_up took 48.7 us against 50.1 with one row a warp and no
  preload, qkv 15.8 against 16.5. Paired, the residual kernels' weight buffer goes to local memory
  (256 bytes a thread; the local ptxas, sm_90), and loading their next group's first weights during
  the lane sums measured slower (down 27.1 us against 24.8, o_proj 10.9 against 9.8), so o_proj and
  down keep one row a warp and load each trip where it starts.
- The prologue writes the staged x 16 bytes at a time, the halves swizzled (``store_stage``). One
  float32 at a time, a thread's 8 elements of a bf16 chunk lie 32 bytes from its neighbour's, so
  every store is an 8-way bank conflict: about 4,000 shared-memory cycles an SM for 16 warps' 32
  stores, which %globaltimer stamps put between a block's x arriving and its barrier (1.5-3.6 us).
  Swizzled, qkv took 15.1 us against 16.1 and gate_up 49.8 against 50.8; without any prologue at
  all they take 14.0 and 49.5.

In the batch-1 Qwen3-8B decode graph: gate_up + SwiGLU 48.0 us, down + residual 24.8, qkv +
RMSNorm 14.6, o_proj + residual 9.6, and the final RMSNorm + lm_head 278.5 (docs/benchmarks.md,
"Decode step profile").
"""

from __future__ import annotations

from typing import Any, Callable

import numpy as np

from executor.kernels.rows.activation import build_swiglu
from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import WARP_THREADS, Kernel, multiprocessor_count
from executor.kernels.rows.norm import build_normalize, inv_rms_from_sum
from executor.kernels.primitives.reduce import block_sum, build_group_sum
from executor.kernels.primitives.vector import (
    VECTOR_WORDS, array_layout, build_lanes, build_shared_vector_load, build_shared_vector_store, build_vector_access,
    lanes_for, vector_aligned, word_type,
)
from executor.numba_cuda import launch_bounds as jit_launch_bounds, load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

#: The kernels' epilogues (module docstring).
STORE, RESIDUAL, SWIGLU = "store", "residual", "swiglu"
#: Defaults from the sweep in the module docstring.
GEMV_WARPS = 4
GEMV_BLOCKS_PER_SM = 4
CHUNKS_PER_LANE = 8  # of each of a warp's rows: 8 KB of loads in flight a warp of two rows
#: The simulator runs every thread as a Python thread: 4 lanes a row there, in one-warp blocks. (Its
#: run time grows much faster than a thread's work: a thread a row took 100 times as long on a tiny down
#: projection.)
SIM_ROW_THREADS = 4


def build_gemv_kernel(
    codec: Codec, batch: int, in_features: int, epilogue: str, *, normed: bool, round_before_weight: bool = True,
    chunks_per_lane: int = CHUNKS_PER_LANE, row_threads: int = WARP_THREADS, threads: int = GEMV_WARPS * WARP_THREADS,
    launch_bounds: tuple[int, int] | None = None, paired: bool = False, float32_out: bool = False,
) -> Callable[..., Any]:
    """Kernel ``(x [B, K], norm_weight [K], weight [N, K], out, eps f32, weight_offset f32)``, storage dtype
    of ``codec``, B = ``batch``, K = ``in_features`` (a whole number of 16-byte chunks; every row 16-byte
    aligned). ``normed``: x is the residual stream, normalized in the prologue with ``norm_weight``,
    ``eps`` and ``weight_offset`` (build_normalize's ``round_before_weight``); else x is the input as
    is and the norm arguments are unused. ``epilogue``: STORE ``out [B, N]``, RESIDUAL ``out [B, N] +=``
    (in place), SWIGLU ``out [B, I]`` with N = 2 I (gate rows, then up rows). A row team owns two weight
    rows, n and n + N / 2, for SWIGLU (gate row n and up row n) and with ``paired`` (N even); else one.
    ``float32_out`` (STORE): ``out`` is float32 and gets each output rounded to the storage dtype, as
    a storage-dtype output converted to float32 (the lm_head's logits).

    ``row_threads`` lanes share a row group (a power of two <= 32: a warp on the GPU, fewer in the
    simulator). Launch with blocks of ``threads`` threads (whole warps: a multiple of row_threads in
    the simulator; a power of two), and ``(B K if normed else 0) + threads`` float32 of dynamic shared
    memory (the staged x, then the reductions' scratch; the simulator's lane sums use it). Any grid.
    """
    if epilogue not in (STORE, RESIDUAL, SWIGLU):
        raise ValueError(f"epilogue must be one of {STORE}, {RESIDUAL}, {SWIGLU}, got {epilogue!r}")
    lanes = lanes_for(codec)
    if in_features % lanes:
        raise ValueError(f"in_features {in_features} is not a whole number of {lanes}-element chunks")
    chunks = in_features // lanes  # a row's 16-byte chunks
    rows = 2 if epilogue == SWIGLU or paired else 1  # weight rows a warp owns: n and n + N / 2
    sweep = row_threads * chunks_per_lane  # chunks a row group covers per trip
    trips = -(-chunks // sweep)
    whole_trips = chunks % sweep == 0  # no bounds check in the chunk loops
    per_word = lanes // VECTOR_WORDS  # elements a 32-bit word
    weight_words, accumulators = rows * chunks_per_lane * VECTOR_WORDS, rows * batch
    stage_floats = batch * in_features if normed else 0
    stage_chunks = -(-chunks // threads)  # chunks of a row one thread normalizes in the prologue
    stage_words, whole_stage = stage_chunks * VECTOR_WORDS, chunks % threads == 0
    wtype = word_type(codec)
    load, store = codec.load, codec.store
    load_vector, _ = build_vector_access()
    load_shared_vector = build_shared_vector_load()
    store_shared_vector = build_shared_vector_store()
    get_lane, _ = build_lanes(codec)
    group_sum = build_group_sum()
    normalize = build_normalize(codec, round_before_weight)
    swiglu = build_swiglu(codec)
    options = jit_launch_bounds(launch_bounds or None)

    @cuda.jit(device=True, inline=True)
    def element(words, start, j):
        """Element j (float32) of the chunk whose words begin at words[start]."""
        return load(get_lane(words, start * per_word + j))

    @cuda.jit(device=True, inline=True)
    def stage_normed(hidden, norm_weight, eps, weight_offset, stage, scratch):
        """stage[b K + k] <- round(RMSNorm(hidden[b])[k]) as float32, by the whole block. A thread
        issues all its chunks' loads before using any: one memory round trip a row, not one a chunk."""
        tid = cuda.threadIdx.x
        h_words = cuda.local.array(stage_words, wtype)
        w_words = cuda.local.array(stage_words, wtype)
        normed = cuda.local.array(lanes, float32)
        for k in range(stage_chunks):  # the norm weight's chunks serve every row
            c = tid + k * threads
            if whole_stage or c < chunks:
                load_vector(norm_weight, (c * lanes,), w_words, k * VECTOR_WORDS)
        for b in range(batch):
            for k in range(stage_chunks):
                c = tid + k * threads
                if whole_stage or c < chunks:
                    load_vector(hidden, (b, c * lanes), h_words, k * VECTOR_WORDS)
            partial = float32(0.0)
            for k in range(stage_chunks):
                c = tid + k * threads
                if whole_stage or c < chunks:
                    for j in range(lanes):
                        v = element(h_words, k * VECTOR_WORDS, j)
                        partial += v * v
            inv_rms = inv_rms_from_sum(block_sum(scratch, partial), in_features, eps)
            for k in range(stage_chunks):
                c = tid + k * threads
                if whole_stage or c < chunks:
                    for j in range(lanes):
                        value = normalize(element(h_words, k * VECTOR_WORDS, j), inv_rms,
                                          element(w_words, k * VECTOR_WORDS, j), weight_offset)
                        normed[j] = load(store(value))
                    store_stage(stage, b * in_features + c * lanes, normed, tid)
        cuda.syncthreads()

    @cuda.jit(device=True, inline=True)
    def store_stage(stage, start, normed, tid):
        """stage[start : start + lanes] <- normed (float32), 16 bytes a store. A bf16 chunk is two stores:
        lanes 32 bytes apart would put every quarter warp's first stores on half the banks (two-way
        conflicts), so lanes 4 to 7 of each 8 store their second half first and each store instruction
        covers the 32 banks once."""
        if lanes == VECTOR_WORDS:  # a float32 chunk: one store
            store_shared_vector(stage, (start,), normed, 0)
        else:
            swap = (tid // 4) % 2 == 1
            first = cuda.local.array(VECTOR_WORDS, float32)
            second = cuda.local.array(VECTOR_WORDS, float32)
            for i in range(VECTOR_WORDS):
                first[i] = normed[VECTOR_WORDS + i] if swap else normed[i]
                second[i] = normed[i] if swap else normed[VECTOR_WORDS + i]
            offset = VECTOR_WORDS if swap else 0
            store_shared_vector(stage, (start + offset,), first, 0)
            store_shared_vector(stage, (start + VECTOR_WORDS - offset,), second, 0)

    @cuda.jit(device=True, inline=True)
    def load_trip(weight, n, second, t, lane, w_buf):
        """Trip t's weight chunks of row group n (its rows n, and n + second when paired) into w_buf."""
        for r in range(rows):
            for u in range(chunks_per_lane):
                c = (t * chunks_per_lane + u) * row_threads + lane
                if whole_trips or c < chunks:
                    load_vector(weight, (n + r * second, c * lanes), w_buf, (r * chunks_per_lane + u) * VECTOR_WORDS)

    @cuda.jit(**options)
    def gemv(x, norm_weight, weight, out, eps, weight_offset):
        lane = cuda.threadIdx.x % row_threads
        teams = threads // row_threads  # row groups a block works on at once
        shared = cuda.shared.array(0, float32)
        scratch = shared[stage_floats:]
        w_buf = cuda.local.array(weight_words, wtype)
        x_words = cuda.local.array(VECTOR_WORDS, wtype)
        x_chunk = cuda.local.array(lanes, float32)
        acc = cuda.local.array(accumulators, float32)
        second = weight.shape[0] // 2  # a warp's second row: n + N / 2 (SWIGLU: the up row of gate row n)
        groups = out.shape[1] if epilogue == SWIGLU else out.shape[1] // rows  # row groups: a warp's rows
        block_first = cuda.blockIdx.x * teams
        if normed:  # the first group's first trip is in flight while the block normalizes x
            if block_first + cuda.threadIdx.x // row_threads < groups:
                load_trip(weight, block_first + cuda.threadIdx.x // row_threads, second, 0, lane, w_buf)
            stage_normed(x, norm_weight, eps, weight_offset, shared, scratch)
        # Every thread of a block takes the same number of trips (the simulator's sums have barriers).
        for first in range(block_first, groups, cuda.gridDim.x * teams):
            n = first + cuda.threadIdx.x // row_threads
            active = n < groups
            for i in range(accumulators):
                acc[i] = float32(0.0)
            if active:
                for t in range(trips):
                    if not (normed and t == 0 and first == block_first):
                        load_trip(weight, n, second, t, lane, w_buf)
                    for u in range(chunks_per_lane):
                        c = (t * chunks_per_lane + u) * row_threads + lane
                        if whole_trips or c < chunks:
                            for b in range(batch):
                                if normed:
                                    for h in range(lanes // VECTOR_WORDS):
                                        load_shared_vector(shared, (b * in_features + c * lanes + h * VECTOR_WORDS,),
                                                           x_chunk, h * VECTOR_WORDS)
                                else:
                                    load_vector(x, (b, c * lanes), x_words, 0)
                                    for j in range(lanes):
                                        x_chunk[j] = element(x_words, 0, j)
                                for j in range(lanes):
                                    for r in range(rows):
                                        w = element(w_buf, (r * chunks_per_lane + u) * VECTOR_WORDS, j)
                                        acc[r * batch + b] += w * x_chunk[j]
            if row_threads > 1:
                for i in range(accumulators):
                    acc[i] = group_sum(scratch, acc[i], row_threads)
            if active and lane == 0:
                for b in range(batch):
                    if epilogue == SWIGLU:
                        out[b, n] = swiglu(store(acc[b]), store(acc[batch + b]))
                    else:
                        for r in range(rows):
                            m = n + r * second
                            if epilogue == RESIDUAL:
                                out[b, m] = store(load(out[b, m]) + load(store(acc[r * batch + b])))
                            elif float32_out:
                                out[b, m] = load(store(acc[r * batch + b]))
                            else:
                                out[b, m] = store(acc[r * batch + b])

    return gemv


class Gemv:
    """Launchers of the three fused GEMVs (module docstring) for one model's codec and norm style.

    Kernels compile per (epilogue, batch, in_features, normed, paired, float32_out) on first use (the eager
    warm-up before graph capture). Arguments are the plan's contiguous, 16-byte-aligned views; the launchers check
    shapes and alignment (a size mismatch is the caller's bug, not a config error). ``warps`` a block and
    ``blocks_per_sm`` (grid and launch bound) default to the sweep's pick (bench/launch_sweep.py).
    """

    def __init__(self, codec: Codec, round_before_weight: bool, blocks_per_sm: int = GEMV_BLOCKS_PER_SM,
                 row_threads: int | None = None, warps: int = GEMV_WARPS) -> None:
        self.codec, self.round_before_weight = codec, round_before_weight
        simulated = simulator_enabled()
        self.row_threads = row_threads or (SIM_ROW_THREADS if simulated else WARP_THREADS)
        self.threads = WARP_THREADS if simulated else warps * WARP_THREADS
        self.teams = self.threads // self.row_threads  # row groups a block works on at once
        self.blocks_per_sm = blocks_per_sm
        self.num_sms = multiprocessor_count()
        self._kernels: dict[tuple[str, int, int, bool, bool, bool], Kernel] = {}

    def norm_project(self, hidden: Any, norm_weight: Any, eps: float, weight_offset: float, weight: Any, out: Any,
                     stream: Any = 0) -> None:
        """``out [B, N] = RMSNorm(hidden [B, K]) @ weight [N, K]^T``; ``out`` in the storage dtype, or float32
        (each output rounded to the storage dtype first)."""
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
        if int(weight.shape[1]) != in_features or tuple(out.shape) != (batch, out_rows):
            raise ValueError(f"gemv {epilogue}: x {tuple(x.shape)}, weight {tuple(weight.shape)}, "
                             f"out {tuple(out.shape)} do not match")
        if not vector_aligned(x, norm_weight, weight):  # out is written an element at a time
            raise ValueError(f"gemv {epilogue}: x, norm_weight and weight rows must be whole 16-byte-aligned chunks")
        # A warp's two rows n and n + N / 2; the residual kernels keep one: paired, ptxas puts their
        # weight buffer in local memory (256 bytes a thread, sm_90).
        paired = epilogue == SWIGLU or (epilogue == STORE and out_rows % 2 == 0)
        # A float32 out of a bf16 model (4-byte elements against 2-byte storage): the logits.
        float32_out = (epilogue == STORE and array_layout(out).itemsize_bytes == 4
                       and np.dtype(self.codec.storage_numpy_dtype).itemsize == 2)
        key = (epilogue, batch, in_features, normed, paired, float32_out)
        kernel = self._kernels.get(key)
        if kernel is None:
            kernel = self._kernels[key] = Kernel(build_gemv_kernel(
                self.codec, batch, in_features, epilogue, normed=normed, round_before_weight=self.round_before_weight,
                row_threads=self.row_threads, threads=self.threads, launch_bounds=(self.threads, self.blocks_per_sm),
                paired=paired, float32_out=float32_out))
        groups = out_rows if epilogue == SWIGLU else out_rows // (2 if paired else 1)
        grid = max(1, min(self.num_sms * self.blocks_per_sm, -(-groups // self.teams)))
        shared_bytes = 4 * ((batch * in_features if normed else 0) + self.threads)
        kernel[grid, self.threads, stream, shared_bytes](x, norm_weight, weight, out, np.float32(eps),
                                                         np.float32(weight_offset))
