"""The gated delta rule for decode steps (one token row per request), bound by moving the state.

A decode step reads and writes every request's float32 state [Hv, dk, dv] once
and does four FLOPs per state element, so this kernel is built to keep many
state bytes in flight. delta_rule.py's kernel is written for prefill (rows
staged in ~28 KB of shared memory per block, 4-byte state loads, barriers
every row) and moves a Qwen3.5-9B decode step (64 requests) at 54% of the
H200's copy bandwidth; this one serves the decode pool with the same math
(delta_rule.py's docstring: HF's recurrent form) and the same arguments.

- Block (column tile, value head h, request) of ``(cols / 4) * R`` threads.
  A thread owns one 16-byte chunk (4 consecutive state columns) in ``dk / R``
  state rows ``rg, rg + R, ...`` (rg = tid % R). The R threads sharing a chunk
  are an aligned group of consecutive lanes of one warp, so their partial dots
  S^T k and S^T q meet through xor shuffles (reduce.py's group sums): no
  shared-memory reduction and no barrier per dot.
- Each thread issues all its 16-byte state loads (vector.py) before anything
  waits; then the row's q and k go to shared memory (2 dk float32: with the
  simulator's reduction scratch, the block's only shared memory) and every
  warp computes the two L2 norms from there (the same order everywhere, so
  every warp gets the same scales). The chunks go back with 16-byte stores.
- The kernel takes the state as a flat view and dv as a constant, so a
  thread's chunks lie at constant offsets from one address.
- Block shape: R 8 row groups and 64 columns (128 threads, 16 state rows of
  4 columns a thread: 64 state registers), launch_bounds for 4 blocks an SM
  (128 registers; ptxas spills 16 bytes). Swept on the H200 (64 requests x 32
  heads x 128 x 128, CUDA-graph timing; docs/benchmarks.md, "Row kernel
  sweeps"): R 8 with 64
  columns 91-92 us, with 32 columns 94 us; R 16 with 64 / 32 / 128 columns
  101 / 97 / 125 us (80-87 registers, no spill); R 32 142-195 us. More state
  rows a thread puts more bytes in flight than the residency it costs.
  delta_rule.py's kernel takes 122.6 us in the same run.

Numerics follow delta_rule.py's kernel up to float32 summation order: beta as
given (the gates kernel rounded it), exp(g) as decay, l2 eps 1e-6, q's scale
dk^-0.5 applied after the dot (o = (S^T q_raw) * q_scale), the HF key head
``h // (Hv // Hk)``, the output rounded by the codec's store. Requests come
through q_indptr as there: an empty request, or one of slot -1 (a graph's
padding), is skipped and its state and rows are untouched. A decode step has
one row a request; a request of several rows is outside this kernel's
contract (prefill steps use delta_rule.py): its rows are set to NaN and its
state is untouched, so a wrong routing shows instead of passing silently.

The launcher falls back to delta_rule.py's kernel when the state is not
contiguous in 16-byte aligned chunks (dv not a multiple of 4, a misaligned
base, a strided view).
"""

from __future__ import annotations

import math
from typing import Any

from executor.kernels.primitives.codec import Codec
from executor.kernels.linear_attention.delta_rule import (
    L2_EPS, GatedDeltaRule, check_delta_rule_shapes, pow2_at_least, qkv_columns,
)
from executor.kernels.primitives.launch import SM_REGISTERS, WARP_THREADS, Kernel
from executor.kernels.primitives.reduce import build_group_sum
from executor.kernels.primitives.vector import VECTOR_WORDS, build_vector_access, contiguous_aligned, vector_aligned
from executor.numba_cuda import launch_bounds, load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)

CHUNK = VECTOR_WORDS  # float32 state columns per 16-byte chunk
DEFAULT_ROW_GROUPS = 8  # threads sharing a state chunk: 16 rows of 4 columns (64 registers) at dk 128
DEFAULT_DV_TILE = 64  # state columns per block: 16 chunks x 8 row groups = 128 threads
REGISTER_OVERHEAD = 48  # registers a thread needs beyond its state words (ptxas, sm_90: 80 at 32 words;
# at 64 words the bound's 4 blocks an SM cap it at 128, which measured faster than 3 without the spill)
SIMULATOR_ROW_GROUPS = 2  # a simulator thread is a Python thread: small blocks there
SIMULATOR_DV_TILE = 8


def build_gated_delta_rule_decode(codec: Codec, head_k_dim: int, head_v_dim: int, row_groups: int,
                                  threads: int) -> Any:
    """Kernel ``(qkv, g, beta, state, q_indptr, slot_ids, out)``.

    qkv [T, 2*Hk*dk + Hv*dv] and out [T, Hv, dv]: ``codec``'s storage; g, beta
    [T, Hv] float32; state: ssm_state [slots, Hv, dk, dv] float32 as a flat
    contiguous view, 16-byte aligned, updated in place; q_indptr [B+1],
    slot_ids [B] int32. dk = ``head_k_dim``, dv = ``head_v_dim`` (a multiple
    of 4). Grid (ceil(dv / cols), Hv, B); 1-D block of ``threads`` =
    (cols / 4) * ``row_groups`` threads, a power of two (a multiple of 32 on
    the GPU); ``row_groups`` a power of two <= 32 dividing dk.
    """
    assert row_groups & (row_groups - 1) == 0 and row_groups <= WARP_THREADS and head_k_dim % row_groups == 0
    assert threads % row_groups == 0 and threads & (threads - 1) == 0 and head_v_dim % CHUNK == 0
    load, store = codec.load, codec.store
    load_vector, store_vector = build_vector_access()
    group_sum = build_group_sum()
    dk, DV, R, NT = head_k_dim, head_v_dim, row_groups, threads
    RPT = dk // R  # state rows per thread
    CHUNKS = NT // R  # state chunks across a block's columns
    STATE_WORDS = RPT * CHUNK  # a thread's state registers
    W = min(WARP_THREADS, NT)  # lanes that sum each norm
    scale = float(dk) ** -0.5
    simulated = simulator_enabled()
    SCRATCH = NT if simulated else 1  # the simulator's group sums go through shared memory
    # launch_bounds: ptxas keeps a thread within SM_REGISTERS / (NT * min_blocks) registers, min_blocks
    # being the blocks an SM holds at STATE_WORDS + REGISTER_OVERHEAD registers a thread (4 for the
    # default block: 128).
    min_blocks = max(1, SM_REGISTERS // (NT * (STATE_WORDS + REGISTER_OVERHEAD)))
    launch_options = launch_bounds((NT, min_blocks))

    @cuda.jit(**launch_options)
    def gated_delta_rule_decode_kernel(qkv, g, beta, state, q_indptr, slot_ids, out):
        q_sh = cuda.shared.array(dk, float32)
        k_sh = cuda.shared.array(dk, float32)
        scratch = cuda.shared.array(SCRATCH, float32)
        s = cuda.local.array(STATE_WORDS, float32)  # registers: this thread's state chunks
        v = cuda.local.array(CHUNK, float32)
        part = cuda.local.array(CHUNK, float32)  # partial, then whole, S^T k or S^T q of the 4 columns
        k_delta = cuda.local.array(CHUNK, float32)
        tid = cuda.threadIdx.x
        rg = tid & (R - 1)  # tid % R, provably >= 0: its indices need no negative-index fix-up
        j0 = (cuda.blockIdx.x * CHUNKS + tid // R) * CHUNK
        h = cuda.blockIdx.y
        req = cuda.blockIdx.z
        v_heads = out.shape[1]
        q_col, k_col, v_col = qkv_columns(qkv.shape[1], v_heads, dk, DV, h)
        v_col += j0
        start = q_indptr[req]
        end = q_indptr[req + 1]
        slot = slot_ids[req]
        # Uniform over the block, before any barrier: an empty request or a graph's padding request.
        if end == start or slot < 0:
            return
        active = j0 < DV  # idle chunks (a tile wider than dv) still take part in the group sums
        if end - start != 1:  # not a decode request (see the module docstring): its rows become NaN
            if active:
                for t in range(start, end):
                    for c in range(CHUNK):
                        if c % R == rg:
                            out[t, h, j0 + c] = store(float32(math.nan))
            return
        t = start
        # This thread's chunks: state[slot, h, i * R + rg, j0 : j0 + 4], i < RPT, at constant offsets.
        first = ((slot * v_heads + h) * dk + rg) * DV + j0
        for i in range(RPT):  # every state load in flight before anything waits
            if active:
                load_vector(state, (first + i * R * DV,), s, i * CHUNK)
            else:
                for c in range(CHUNK):
                    s[i * CHUNK + c] = float32(0.0)
        for i in range(tid, dk, NT):
            q_sh[i] = load(qkv[t, q_col + i])
            k_sh[i] = load(qkv[t, k_col + i])
        decay = float32(math.exp(g[t, h]))
        b = beta[t, h]
        for c in range(CHUNK):
            v[c] = load(qkv[t, v_col + c]) if active else float32(0.0)
        cuda.syncthreads()
        q_sq = float32(0.0)
        k_sq = float32(0.0)
        for i in range(tid & (W - 1), dk, W):
            q_sq += q_sh[i] * q_sh[i]
            k_sq += k_sh[i] * k_sh[i]
        q_scale = float32(scale) / float32(math.sqrt(group_sum(scratch, q_sq, W) + float32(L2_EPS)))
        k_scale = float32(1.0) / float32(math.sqrt(group_sum(scratch, k_sq, W) + float32(L2_EPS)))
        # S *= exp(g); kv = S^T k (raw k, scaled below)
        for c in range(CHUNK):
            part[c] = float32(0.0)
        for i in range(RPT):
            k_i = k_sh[i * R + rg]
            for c in range(CHUNK):
                s[i * CHUNK + c] *= decay
                part[c] += s[i * CHUNK + c] * k_i
        for c in range(CHUNK):
            kv = group_sum(scratch, part[c], R)
            k_delta[c] = k_scale * (b * (v[c] - kv * k_scale))  # k_n delta^T = k (k_scale delta)^T
            part[c] = float32(0.0)
        # S += k delta^T; o = S^T q (raw q, scaled at the store)
        for i in range(RPT):
            k_i = k_sh[i * R + rg]
            q_i = q_sh[i * R + rg]
            for c in range(CHUNK):
                s[i * CHUNK + c] += k_i * k_delta[c]
                part[c] += s[i * CHUNK + c] * q_i
        for c in range(CHUNK):
            o = group_sum(scratch, part[c], R)
            if active and c % R == rg:  # the group's lanes share the 4 stores
                out[t, h, j0 + c] = store(o * q_scale)
        if active:
            for i in range(RPT):
                store_vector(state, (first + i * R * DV,), s, i * CHUNK)

    return gated_delta_rule_decode_kernel


class GatedDeltaRuleDecode:
    """Launcher of the decode delta rule; ``ssm_state`` is updated in place.

    Same arguments as ``GatedDeltaRule.__call__``: qkv [T, 2*Hk*dk + Hv*dv]
    storage dtype; g, beta [T, Hv] float32; ssm_state [slots, Hv, dk, dv]
    float32; q_indptr [B+1], slot_ids [B] int32 (slots distinct; -1 skipped);
    out [T, Hv, dv] storage dtype, not aliasing qkv. Every request has one
    row or none (a decode step's q_indptr). No scratch.

    ``row_groups`` (a power of two <= 32 dividing dk; default the largest
    such <= DEFAULT_ROW_GROUPS): threads sharing a state chunk, each holding dk / row_groups
    of its rows. ``dv_tile`` (a power of two >= 4, default 64): state columns
    per block. ``fallback`` (the step's general launcher) runs calls whose
    state is not contiguous in aligned 16-byte chunks.
    """

    def __init__(self, codec: Codec, head_k_dim: int, fallback: GatedDeltaRule, *, row_groups: int | None = None,
                 dv_tile: int | None = None) -> None:
        simulated = simulator_enabled()
        if row_groups is None:
            row_groups = SIMULATOR_ROW_GROUPS if simulated else DEFAULT_ROW_GROUPS
            while head_k_dim % row_groups:
                row_groups //= 2
        if row_groups < 1 or row_groups > WARP_THREADS or row_groups & (row_groups - 1) or head_k_dim % row_groups:
            raise ValueError(f"gated_delta_rule_decode: row_groups must be a power of two <= {WARP_THREADS} dividing "
                             f"head_k_dim {head_k_dim}, got {row_groups}")
        dv_tile = dv_tile or (SIMULATOR_DV_TILE if simulated else DEFAULT_DV_TILE)
        if dv_tile < CHUNK or dv_tile & (dv_tile - 1) or dv_tile // CHUNK * row_groups > 1024:
            raise ValueError(f"gated_delta_rule_decode: dv_tile must be a power of two >= {CHUNK} with "
                             f"dv_tile / {CHUNK} * row_groups <= 1024, got {dv_tile} (row_groups {row_groups})")
        self.codec, self.head_k_dim, self.fallback = codec, head_k_dim, fallback
        self.row_groups, self.dv_tile = row_groups, dv_tile
        self.min_threads = 1 if simulated else WARP_THREADS  # the GPU's shuffles take whole warps
        self.kernels: dict[tuple[int, int], Kernel] = {}  # (dv, threads) -> kernel: one per model

    def uses_vector(self, ssm_state: Any) -> bool:
        """Whether a call with this state runs this module's kernel (else the fallback's): the state
        is contiguous (so a flat view of it exists) in 16-byte aligned chunks."""
        return vector_aligned(ssm_state) and contiguous_aligned(ssm_state)

    def block_threads(self, dv: int) -> int:
        """Threads of a block for value heads of ``dv`` columns: (cols / 4) x row_groups."""
        cols = min(self.dv_tile, pow2_at_least(dv))
        return max(cols // CHUNK * self.row_groups, self.min_threads)

    def __call__(self, qkv: Any, g: Any, beta: Any, ssm_state: Any, q_indptr: Any, slot_ids: Any, out: Any,
                 stream: Any = 0) -> None:
        if not self.uses_vector(ssm_state):
            self.fallback(qkv, g, beta, ssm_state, q_indptr, slot_ids, out, stream=stream)
            return
        v_heads, dv, requests = check_delta_rule_shapes(qkv, g, beta, ssm_state, q_indptr, slot_ids, out,
                                                        self.head_k_dim)
        if requests == 0 or int(qkv.shape[0]) == 0:
            return
        threads = self.block_threads(dv)
        kernel = self.kernels.get((dv, threads))
        if kernel is None:
            kernel = self.kernels[(dv, threads)] = Kernel(
                build_gated_delta_rule_decode(self.codec, self.head_k_dim, dv, self.row_groups, threads))
        cols = threads // self.row_groups * CHUNK
        grid = ((dv + cols - 1) // cols, v_heads, requests)
        kernel[grid, threads, stream](qkv, g, beta, ssm_state.reshape(-1), q_indptr, slot_ids, out)
