"""The gated delta rule in chunked (WY / UT) form, for prefill chunks: small matrix products per
chunk of C tokens instead of one token after another.

The recurrence is delta_rule.py's (its docstring: HF's ``torch_recurrent_gated_delta_rule``). For
one request and value head, split the request's rows of this step into chunks of C rows from its
first row (a step's rows may start at any cached length: the chunking is relative to the step,
and the state carries across steps). Within a chunk, with S the state [dk, dv] before it, k and q
L2-normalised (q also scaled by dk^-0.5), gc the inclusive cumulative sum of g within the chunk and
gl = gc[C - 1]::

    A[i, j] = beta_i exp(gc_i - gc_j) k_i . k_j     for j < i, else 0
    T = (I + A)^-1                                  (unit lower triangular)
    delta = T (beta * (v - exp(gc) * (k S)))        the chunk's delta rows (v_new), all at once
    o = exp(gc) * (q S) + P delta,  P[i, j] = exp(gc_i - gc_j) q_i . k_j for j <= i, else 0
    S <- exp(gl) S + k^T (exp(gl - gc) * delta)

which is the recurrence exactly: delta_i = beta_i (v_i - S_{i-1}^T k_i) solves (I + A) delta =
beta (v - exp(gc) k S) row by row (Gated DeltaNet's WY representation, as flash-linear-attention's
chunk_gated_delta_rule computes it with w = T (beta exp(gc) k) and u = T (beta v); here
delta = T (beta (v - exp(gc) k S)) takes one product less and never forms w). Every exponent is
<= 0: no decay overflows.

The norms are not applied to the staged q and k: the products run on the stored rows and the
scales (1 / |k_i|, dk^-0.5 / |q_i|) multiply their results, so the tensor cores read the
activations as they are stored.

Steps 1-4 below need no state: only 5-7 carry it from chunk to chunk. Per chunk:

1. stage q, k (the value head's key head, h // (Hv // Hk)) and v rows, zeros past the request's
   rows; g and beta (0 past them: such rows change nothing);
2. per row: the two norms, gc, exp(gc), exp(gl - gc);
3. the Gram products k k^T and q k^T (C x C, over dk) -> A (float32) and P;
4. T = (I + A)^-1 in float32: forward substitution within diagonal blocks of ``solve_block``
   rows (a row a lane, in registers), then the blocks below them (T_IJ = -T_II sum_K A_IK T_KJ),
   all blocks at one distance from the diagonal at once;
5. k S and q S (C x DVT, over dk) -> the residual beta (v - exp(gc) k S) and exp(gc) q S;
6. delta = T residual (C x DVT, over C);
7. o += P delta (written out), and S <- exp(gl) S + k^T (exp(gl - gc) delta) (dk x DVT, over C).

Two builds:

- tensor cores (bf16 storage), two launches. The prepare pass runs steps 1-4 for every chunk of
  the step at once, one block per (chunk, value head), and writes T, P (bf16) and five float32
  factors of each row (beta, the decay-weighted norms, the chunk's exp(gl)) to the plan's per-row
  scratch (the prefill pool's delta_transform, delta_gram, delta_scalars: a row's chunk row of
  each, so no chunk table exists). The scan then runs steps 5-7: one block per (dv tile, value
  head, request), grid (dv / DVT, Hv, B), walking the request's chunks in order with the state
  tile [dk, DVT] in registers; a chunk's q, k, v, T, P and factors arrive by ``cp.async`` in one of
  two buffers while the chunk before runs on the other (``ChunkShape.buffers``), so the sequential
  path is four products a chunk. Every product is ``mma.sync`` m16n8k16 with float32 accumulation
  (primitives/mma.py): operands bf16 in shared memory read by ``ldmatrix`` (k^T's fragments by its
  transposed form, so no transposed copy exists), each warp owning one 16-row tile of the state,
  which is also kept rounded to bf16 in shared memory as the B operand of k S and q S. A and the
  solve stay float32; T, P, the residual and delta are rounded to bf16 as operands (as fla rounds
  its w, u, T and h). One block per (chunk, key head) serving its value heads in turn (staging q
  and k and their dots once) measured 5% slower on the H200 than a block per value head: half the
  blocks, each running its heads' solves one after another.
- float32 (any other storage: the simulator's tests, float32 models): one launch, one block per
  (dv tile, value head, request) running all seven steps per chunk with every product a float32
  loop over shared tiles, the state in shared memory: no global scratch.

In the simulator the tensor-core build runs too: primitives/mma.py emulates mma.sync and ldmatrix.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable

from planner.kernel_limits import DELTA_RULE_CHUNK, DELTA_RULE_ROW_SCALARS

from executor.kernels.linear_attention.delta_rule import L2_EPS, GatedDeltaRule, check_delta_rule_shapes, qkv_columns
from executor.kernels.primitives.async_copy import build_async_copy, build_copy_groups, build_shared_address
from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.indices import build_indices
from executor.kernels.primitives.launch import BLOCK_THREADS, WARP_THREADS, Kernel, multiprocessor_count
from executor.kernels.primitives.mma import build_a_fragment_load, build_fragment_loads, build_mma_bf16, build_pack_bf16x2
from executor.kernels.primitives.shared_tile import build_shared_tile
from executor.kernels.primitives.vector import (as_words, build_shared_vector_load, build_shared_vector_store,
                                                vector_aligned)
from executor.numba_cuda import launch_bounds, load_cuda, simulator_enabled
from executor.routing import CHUNKED_DELTA_RULE_NARROW_SCAN_SMS_PER_BLOCK

cuda = load_cuda()
from numba import float32, int32, uint64  # noqa: E402  (after load_cuda's numpy fix)

# Shared-tile subscripts are cast to uint64 where the loops and the solve index them: Numba wraps a
# negative signed index around (a compare, a select and a multiply-add a subscript, which LLVM cannot
# drop for indices built in loops), and an unsigned one is taken as it is, so the unrolled loops' loads
# fold into one base address plus constant offsets.
U = uint64

#: sm_90's most shared memory a block may take (static and dynamic, after opting in).
MAX_SHARED_BYTES = 227 * 1024
PAD_WORDS = 4  # per bf16 operand row: shifts consecutive rows by 4 banks, rows stay 16-byte aligned
FLOAT_PAD = 4  # per float32 row of A and T
# Rows of the per-row scalars tile.
G, GC, BETA, QS, KS, EGC, DL = range(7)
SCALARS = 7
# Columns of a row's factors in the scalars scratch (the prepare pass writes them, the scan reads them):
# beta, exp(gc) / |k|, exp(gc) dk^-0.5 / |q|, exp(gl - gc) / |k| and the chunk's exp(gl).
ROW_BETA, ROW_KEY, ROW_QUERY, ROW_UPDATE, ROW_CARRY = range(5)
ROW_SCALARS = DELTA_RULE_ROW_SCALARS
assert ROW_CARRY < ROW_SCALARS and ROW_SCALARS % 4 == 0  # whole 16-byte chunks a row


@dataclass(frozen=True)
class ChunkShape:
    """A block's work: ``chunk`` token rows a round (C), ``dv_tile`` state columns (DVT),
    ``warps`` warps, the solve's diagonal blocks of ``solve_block`` rows, and the scan's copies of
    a chunk's staged inputs (tensor cores): 2 overlaps a chunk's copies with the chunk before, 1
    stages after each chunk in about half the shared memory, two blocks an SM."""

    chunk: int
    dv_tile: int
    warps: int
    solve_block: int
    buffers: int = 2

    @property
    def threads(self) -> int:
        return WARP_THREADS * self.warps


#: The GPU's tensor-core shape: 64-token chunks (fla's), 64 state columns and 8 warps a block (a
#: warp owns one 16-row tile of the chunk and half its columns, one 16-row tile of the state: 32
#: state registers a lane), 16-row diagonal blocks in the solve, two scan buffers: 171 KiB of shared
#: memory for the scan (one block an SM), 83 KiB for the prepare pass (two). On the H200
#: (bench/delta_rule.py --shapes, docs/benchmarks.md) 32 state columns win only where one request
#: leaves SMs idle, one scan buffer only from 8 requests on, by 3-4%.
GPU_SHAPE = ChunkShape(chunk=DELTA_RULE_CHUNK, dv_tile=64, warps=8, solve_block=16)
#: GPU_SHAPE's scan at 32 state columns: twice the blocks, each half the work a chunk, two an SM. The
#: launcher runs it where GPU_SHAPE's scan grid leaves SMs idle (routing.py
#: CHUNKED_DELTA_RULE_NARROW_SCAN_SMS_PER_BLOCK); the prepare pass is GPU_SHAPE's either way.
GPU_NARROW_SHAPE = ChunkShape(chunk=DELTA_RULE_CHUNK, dv_tile=32, warps=8, solve_block=16)
#: The GPU's float32 build (float32 storage): small tiles, every product a float32 loop (~46 KiB at dk 128).
GPU_FLOAT32_SHAPE = ChunkShape(chunk=16, dv_tile=32, warps=4, solve_block=8)
#: The simulator's: one warp, 16-token chunks, two diagonal blocks (the block merge runs).
SIMULATOR_SHAPE = ChunkShape(chunk=16, dv_tile=16, warps=1, solve_block=8)


@dataclass(frozen=True)
class WarpTiles:
    """How a block's warps share one product's 16-row m-tiles and 8-column n-tiles: warp w takes
    m-tile ``w % m_tiles`` and the ``w // m_tiles``-th run of ``n_tiles`` n-tiles. One m-tile a warp
    keeps every accumulator index a constant (a loop over several would put them in local memory)."""

    m_tiles: int
    n_tiles: int


def warp_tiles(rows: int, cols: int, warps: int) -> WarpTiles:
    """The split of a [rows, cols] product over ``warps`` warps (rows, cols multiples of 16)."""
    m_tiles = rows // 16
    if warps % m_tiles:
        raise ValueError(f"chunked delta rule: {warps} warps cannot take one of {m_tiles} row tiles each")
    parts = warps // m_tiles
    n_tiles = cols // 8 // parts
    if n_tiles < 2 or n_tiles % 2 or n_tiles * parts * 8 != cols:
        raise ValueError(f"chunked delta rule: {cols} columns in {parts} parts is not a whole even number of "
                         f"8-column tiles a warp")
    return WarpTiles(m_tiles, n_tiles)


@dataclass(frozen=True)
class SharedLayout:
    """Offsets (in 4-byte words) of a block's tiles in dynamic shared memory, and their shapes."""

    tiles: dict[str, tuple[int, int, int]]  # name -> (offset, rows, words)
    words: int
    stride: int = 0  # words from one copy of a copied layout's tiles to the next (scan_layout's two buffers)

    @property
    def bytes(self) -> int:
        return 4 * self.words


def _layout(shapes: dict[str, tuple[int, int]], copies: int = 1, shared: dict[str, tuple[int, int]] | None = None
            ) -> SharedLayout:
    """Tiles ``shapes`` (name -> (rows, words)) ``copies`` times over (a copy's tiles lie ``stride`` words
    after the previous copy's), then ``shared``'s once; each tile starts 16-byte aligned."""
    tiles, offset = {}, 0
    for name, (rows, words) in shapes.items():
        tiles[name] = (offset, rows, words)
        offset += -(-rows * words // 4) * 4
    stride = offset
    offset *= copies
    for name, (rows, words) in (shared or {}).items():
        tiles[name] = (offset, rows, words)
        offset += -(-rows * words // 4) * 4
    return SharedLayout(tiles, offset, stride)


def _operand(cols: int) -> int:
    """Words of a padded bf16 operand row of ``cols`` values."""
    return cols // 2 + PAD_WORDS


def fused_layout(head_k_dim: int, shape: ChunkShape) -> SharedLayout:
    """The float32 build's tiles, every one float32."""
    C, DK, DVT, SB = shape.chunk, head_k_dim, shape.dv_tile, shape.solve_block
    return _layout({
        "q": (C, DK), "k": (C, DK), "v": (C, DVT), "s": (DK, DVT), "t": (C, C), "p": (C, C), "r": (C, DVT),
        "n": (C, DVT), "d": (C, DVT), "o": (C, DVT), "a": (C, C), "tf": (C, C), "m": (SB, C),
        "scalars": (SCALARS, C),
    })


def prepare_layout(head_k_dim: int, shape: ChunkShape) -> SharedLayout:
    """The tensor-core prepare pass's tiles: q, k and P as bf16 operand words, A and T float32."""
    C, DK, SB = shape.chunk, head_k_dim, shape.solve_block
    return _layout({
        "q": (C, _operand(DK)), "k": (C, _operand(DK)), "p": (C, _operand(C)), "a": (C, C + FLOAT_PAD),
        "tf": (C, C + FLOAT_PAD), "m": (SB, C), "scalars": (SCALARS, C), "found": (1, 4),
    })


def scan_layout(head_k_dim: int, shape: ChunkShape) -> SharedLayout:
    """The tensor-core scan's tiles: two copies of a chunk's staged inputs (q, k, v, T, P as bf16
    operand words and the row factors, float32), then the state's bf16 copy, the residual, delta and
    the decayed delta."""
    C, DK, DVT = shape.chunk, head_k_dim, shape.dv_tile
    return _layout({"q": (C, _operand(DK)), "k": (C, _operand(DK)), "v": (C, _operand(DVT)), "t": (C, _operand(C)),
                    "p": (C, _operand(C)), "rows": (C, ROW_SCALARS)},
                   copies=shape.buffers,
                   shared={"s": (DK, _operand(DVT)), "r": (C, _operand(DVT)), "n": (C, _operand(DVT)),
                           "d": (C, _operand(DVT))})


def shared_layouts(head_k_dim: int, shape: ChunkShape, tensor_cores: bool) -> tuple[SharedLayout, ...]:
    """The layouts of the build's kernels: the float32 build's one, or the tensor-core build's prepare
    pass and scan."""
    if tensor_cores:
        return prepare_layout(head_k_dim, shape), scan_layout(head_k_dim, shape)
    return (fused_layout(head_k_dim, shape),)


def check_shape(head_k_dim: int, shape: ChunkShape, tensor_cores: bool) -> None:
    """Raise ValueError unless the kernels can be built for this shape."""
    C, SB = shape.chunk, shape.solve_block
    if C < 1 or SB < 4 or SB % 4 or C % SB or WARP_THREADS % SB or SB * C < shape.threads:
        raise ValueError(f"chunked delta rule: solve_block {SB} must be a multiple of 4 (the merge's four columns a "
                         f"thread) dividing chunk {C} and {WARP_THREADS} (a lane a row), with solve_block x chunk >= "
                         f"the block's {shape.threads} threads")
    if shape.buffers not in (1, 2):
        raise ValueError(f"chunked delta rule: buffers must be 1 or 2, got {shape.buffers}")
    if shape.dv_tile < 1 or shape.warps < 1 or shape.threads > BLOCK_THREADS:
        raise ValueError(f"chunked delta rule: need dv_tile >= 1 and 1..{BLOCK_THREADS // WARP_THREADS} warps, got "
                         f"{shape}")
    if tensor_cores:
        for name, value in (("chunk", C), ("head_k_dim", head_k_dim), ("dv_tile", shape.dv_tile)):
            if value % 16:
                raise ValueError(f"chunked delta rule: {name} {value} must be a multiple of 16 on tensor cores")
        warp_tiles(C, C, shape.warps)
        warp_tiles(C, shape.dv_tile, shape.warps)
        warp_tiles(head_k_dim, shape.dv_tile, shape.warps)
    for layout in shared_layouts(head_k_dim, shape, tensor_cores):
        if layout.bytes > MAX_SHARED_BYTES:
            raise ValueError(f"chunked delta rule: {shape} at head_k_dim {head_k_dim} stages {layout.bytes} bytes of "
                             f"shared memory, more than the {MAX_SHARED_BYTES} a block may take")


def build_chunked_delta_rule(codec: Codec, head_k_dim: int, head_v_dim: int, shape: ChunkShape,
                             tensor_cores: bool) -> tuple[Any, ...]:
    """The build's kernels (``ChunkedGatedDeltaRule`` launches them).

    float32 build: one kernel ``(qkv, g, beta, ssm_state, q_indptr, slot_ids, out)``, grid
    (ceil(dv / DVT), Hv, B).

    Tensor cores: ``(prepare, scan)``. prepare ``(qkv, g, beta, q_indptr, slot_ids, transform, gram,
    scalars)``, grid (T // C + B, Hv): block x takes the chunk whose request r and chunk index j give
    x = (q_indptr[r] - q_indptr[0]) // C + r + j (those ranges partition the grid; a block past its
    request's chunks returns). scan ``(qkv, ssm_state, q_indptr, slot_ids, transform, gram, scalars,
    out)``, grid (dv / DVT, Hv, B).

    qkv [T, 2 Hk dk + Hv dv] in ``codec``'s storage; g, beta [T, Hv] float32; ssm_state [slots, Hv,
    dk, dv] float32, updated in place; q_indptr [B + 1], slot_ids [B] int32 (slot -1 or an empty
    request: skipped). out: [T, Hv, dv] in ``codec``'s storage (float32 build), or as int32 words
    [T, Hv, dv / 2] of bf16 pairs (tensor cores, whose qkv rows are then 16-byte aligned and dv a
    multiple of DVT). transform, gram: int32 words [T, Hv, >= C / 2] of bf16 pairs, row t's first C
    values the row of its chunk's T and P; scalars float32 [T, Hv, ROW_SCALARS], row t's factors
    (ROW_BETA ...).
    """
    check_shape(head_k_dim, shape, tensor_cores)
    layouts = shared_layouts(head_k_dim, shape, tensor_cores)
    rows = _RowMath(shape)
    if not tensor_cores:
        return (_float32_kernel(codec, head_k_dim, shape, _Tiles(layouts[0]), rows),)
    parts = _TensorCoreParts(codec, head_k_dim, shape)
    return (_prepare_kernel(codec, head_k_dim, head_v_dim, shape, _Tiles(layouts[0]), rows, parts),
            _scan_kernel(codec, head_k_dim, shape, _Tiles(layouts[1]), parts))


class _Tiles:
    """Each tile of a SharedLayout as (offset, device function ``tile(dynamic, offset) -> 2-D view``)."""

    def __init__(self, layout: SharedLayout) -> None:
        self.views = {name: (offset, build_shared_tile(rows, words))
                      for name, (offset, rows, words) in layout.tiles.items()}
        self.stride = layout.stride

    def __getitem__(self, name: str) -> tuple[int, Any]:
        return self.views[name]


def _build_row_exchange(chunk: int) -> Any:
    """``exchange(scratch, value, source, tid)``: the value lane ``source`` of this thread's warp passes,
    every thread of the block calling it together. On the GPU a shuffle; the simulator (which has
    none) passes it through ``scratch`` (an [SB, chunk] float32 tile, SB x chunk >= the block's threads)
    between two barriers."""
    if not simulator_enabled():
        @cuda.jit(device=True, inline=True)
        def shuffle(scratch, value, source, tid):
            return cuda.shfl_sync(0xFFFFFFFF, value, source)

        return shuffle

    @cuda.jit(device=True)
    def through_shared(scratch, value, source, tid):
        scratch[tid // chunk, tid % chunk] = value
        cuda.syncthreads()
        at = (tid // WARP_THREADS) * WARP_THREADS + source
        got = scratch[at // chunk, at % chunk]
        cuda.syncthreads()
        return got

    return through_shared


class _RowMath:
    """The device functions both builds share: the per-row scalars, the Gram epilogue and the solve."""

    def __init__(self, shape: ChunkShape) -> None:
        C, SB, NT, NW = shape.chunk, shape.solve_block, shape.threads, shape.warps
        NB = C // SB  # diagonal blocks of the solve

        @cuda.jit(device=True, inline=True)
        def decay(sc, i, j):
            """exp(gc_i - gc_j), clamped at exponent 0 (the masked j > i would overflow)."""
            return float32(math.exp(min(sc[GC, U(i)] - sc[GC, U(j)], float32(0.0))))

        @cuda.jit(device=True, inline=True)
        def gram_values(sc, i, j, kk, qk):
            """(A[i, j], P[i, j]) from the stored rows' dots k_i . k_j and q_i . k_j."""
            a = float32(0.0)
            p = float32(0.0)
            if j <= i:
                f = decay(sc, i, j) * sc[KS, U(j)]
                p = f * sc[QS, U(i)] * qk
                if j < i:
                    a = f * sc[BETA, U(i)] * sc[KS, U(i)] * kk
            return a, p

        @cuda.jit(device=True, inline=True)
        def cumulative_decay(sc, r):
            """gc[r], exp(gc[r]) and exp(gl - gc[r]) into the scalars tile (g staged in sc[G])."""
            partial = float32(0.0)
            total = float32(0.0)
            for j in range(C):  # the same order in every thread: gc[C - 1] equals total bit for bit
                x = sc[G, U(j)]
                total += x
                if j <= r:
                    partial += x
            sc[GC, U(r)] = partial
            sc[EGC, U(r)] = float32(math.exp(partial))
            sc[DL, U(r)] = float32(math.exp(total - partial))

        SPAN = WARP_THREADS // SB  # diagonal blocks a warp inverts at once, SB lanes each
        exchange = _build_row_exchange(C)
        SKIP_IDLE_WARPS = not simulator_enabled()
        load_quad, store_quad = build_shared_vector_load(), build_shared_vector_store()

        @cuda.jit(device=True, inline=True)
        def diagonal_inverses(af, tf, mf, tid):
            """tf's diagonal blocks <- the inverses of (I + A)'s, by forward substitution over rows: lane i
            of a block's SB lanes holds row i of its inverse in registers, and at step j every row below
            j takes A[i, j] times row j, which lane j (final by then) shuffles to the others. The column
            loops unroll (constant indices); lanes past the last block take every step with A read as 0,
            and on the GPU a warp with no block skips them (in the simulator every thread takes part in
            the exchange's barriers; mf is its scratch)."""
            lane = tid % WARP_THREADS
            i = lane % SB
            row = cuda.local.array(SB, float32)
            for first in range(0, NB, SPAN * NW):
                warp_first = first + SPAN * (tid // WARP_THREADS)
                if SKIP_IDLE_WARPS and warp_first >= NB:
                    continue  # the warp holds no block: on the GPU its exchange is its own shuffle, so it may skip
                block = warp_first + lane // SB
                base = block * SB
                for c in range(SB):
                    row[c] = float32(1.0) if c == i else float32(0.0)
                for j in range(SB - 1):
                    a = af[U(base + i), U(base + j)] if block < NB and i > j else float32(0.0)
                    source = (lane // SB) * SB + j
                    for c in range(SB):
                        row[c] -= a * exchange(mf, row[c], source, tid)
                if block < NB:
                    for c in range(SB):
                        tf[U(base + i), U(base + c)] = row[c]

        QUADS = SB // 4  # a thread's four adjacent columns of a block row: one 16-byte shared load a step
        ITEMS = SB * QUADS  # a block's (row, quad) items

        @cuda.jit(device=True, inline=True)
        def merge_blocks(af, tf, mf, tid):
            """tf's blocks below the diagonal, by their distance d from it: T_IJ = -T_II sum_{J <= K < I}
            A_IK T_KJ reads only blocks nearer the diagonal, so the NB - d blocks at distance d are
            computed at once, a thread four adjacent elements of a row (mf, an [SB, C] tile, holds their
            sums): a step of a sum is one load of A (or T) and one 16-byte load of four T (or X) values
            for four products. Every loop over a block's SB columns has constant bounds (it unrolls).
            Starts and ends with a barrier."""
            quad = cuda.local.array(4, float32)
            for d in range(1, NB):
                cuda.syncthreads()
                for e in range(tid, (NB - d) * ITEMS, NT):  # the sums X_IJ = sum_K A_IK T_KJ, J = e // ITEMS
                    j = e // ITEMS
                    r = (e - j * ITEMS) // QUADS
                    c = j * SB + 4 * (e - j * ITEMS - r * QUADS)
                    row = (j + d) * SB + r
                    x0 = float32(0.0)
                    x1 = float32(0.0)
                    x2 = float32(0.0)
                    x3 = float32(0.0)
                    for k in range(j, j + d):
                        for u in range(SB):
                            a = af[U(row), U(k * SB + u)]
                            load_quad(tf, (U(k * SB + u), U(c)), quad, 0)
                            x0 += a * quad[0]
                            x1 += a * quad[1]
                            x2 += a * quad[2]
                            x3 += a * quad[3]
                    quad[0] = x0
                    quad[1] = x1
                    quad[2] = x2
                    quad[3] = x3
                    store_quad(mf, (U(r), U(c)), quad, 0)
                cuda.syncthreads()
                for e in range(tid, (NB - d) * ITEMS, NT):  # T_IJ = -T_II X_IJ
                    j = e // ITEMS
                    r = (e - j * ITEMS) // QUADS
                    c = j * SB + 4 * (e - j * ITEMS - r * QUADS)
                    i = (j + d) * SB
                    y0 = float32(0.0)
                    y1 = float32(0.0)
                    y2 = float32(0.0)
                    y3 = float32(0.0)
                    for u in range(SB):
                        t = tf[U(i + r), U(i + u)]
                        load_quad(mf, (U(u), U(c)), quad, 0)
                        y0 += t * quad[0]
                        y1 += t * quad[1]
                        y2 += t * quad[2]
                        y3 += t * quad[3]
                    quad[0] = -y0
                    quad[1] = -y1
                    quad[2] = -y2
                    quad[3] = -y3
                    store_quad(tf, (U(i + r), U(c)), quad, 0)
            cuda.syncthreads()

        @cuda.jit(device=True, inline=True)
        def solve(af, tf, mf, tid):
            """tf <- (I + A)^-1 on and below the diagonal (A strictly lower in af), float32; mf is an
            [SB, C] scratch tile. Ends with a barrier."""
            diagonal_inverses(af, tf, mf, tid)
            merge_blocks(af, tf, mf, tid)

        self.gram_values, self.cumulative_decay, self.solve = gram_values, cumulative_decay, solve


def _float32_kernel(codec: Codec, head_k_dim: int, shape: ChunkShape, tiles: _Tiles, rows: _RowMath) -> Any:
    """The float32 build (module docstring)."""
    C, DK, DVT, NT = shape.chunk, head_k_dim, shape.dv_tile, shape.threads
    scale = float(DK) ** -0.5
    load, store = codec.load, codec.store
    gram_values, cumulative_decay, solve = rows.gram_values, rows.cumulative_decay, rows.solve
    Q_OFF, q_tile = tiles["q"]
    K_OFF, k_tile = tiles["k"]
    V_OFF, v_tile = tiles["v"]
    S_OFF, s_tile = tiles["s"]
    T_OFF, t_tile = tiles["t"]
    P_OFF, p_tile = tiles["p"]
    R_OFF, r_tile = tiles["r"]
    N_OFF, n_tile = tiles["n"]
    D_OFF, d_tile = tiles["d"]
    O_OFF, o_tile = tiles["o"]
    A_OFF, a_tile = tiles["a"]
    TF_OFF, tf_tile = tiles["tf"]
    M_OFF, m_tile = tiles["m"]
    SC_OFF, scalars_tile = tiles["scalars"]
    ALIGNMENT = None if simulator_enabled() else 16
    @cuda.jit(device=True, inline=True)
    def sum_squares(tile, r):
        acc = float32(0.0)
        for i in range(DK):
            acc += tile[r, i] * tile[r, i]
        return acc

    @cuda.jit
    def chunked_delta_rule_f32(qkv, g, beta, ssm_state, q_indptr, slot_ids, out):
        dyn = cuda.shared.array(0, float32, alignment=ALIGNMENT)
        qt, kt, vt, st = q_tile(dyn, Q_OFF), k_tile(dyn, K_OFF), v_tile(dyn, V_OFF), s_tile(dyn, S_OFF)
        tt, pt, rt, nt = t_tile(dyn, T_OFF), p_tile(dyn, P_OFF), r_tile(dyn, R_OFF), n_tile(dyn, N_OFF)
        dt, ot, af, tf = d_tile(dyn, D_OFF), o_tile(dyn, O_OFF), a_tile(dyn, A_OFF), tf_tile(dyn, TF_OFF)
        mf, sc = m_tile(dyn, M_OFF), scalars_tile(dyn, SC_OFF)
        tid = cuda.threadIdx.x
        j0 = cuda.blockIdx.x * DVT
        h = cuda.blockIdx.y
        req = cuda.blockIdx.z
        start = q_indptr[req]
        end = q_indptr[req + 1]
        slot = slot_ids[req]
        if end == start or slot < 0:  # uniform over the block: nobody waits at a barrier
            return
        v_heads = ssm_state.shape[1]
        dv = ssm_state.shape[3]
        q_col, k_col, v_col = qkv_columns(qkv.shape[1], v_heads, DK, dv, h)
        for e in range(tid, DK * DVT, NT):
            d = e // DVT
            c = e - d * DVT
            st[d, c] = ssm_state[slot, h, d, j0 + c] if j0 + c < dv else float32(0.0)
        for c0 in range(start, end, C):
            n = min(C, end - c0)
            for e in range(tid, C * DK, NT):
                r = e // DK
                i = e - r * DK
                qt[r, i] = load(qkv[c0 + r, q_col + i]) if r < n else float32(0.0)
                kt[r, i] = load(qkv[c0 + r, k_col + i]) if r < n else float32(0.0)
            for e in range(tid, C * DVT, NT):
                r = e // DVT
                c = e - r * DVT
                vt[r, c] = load(qkv[c0 + r, v_col + j0 + c]) if r < n and j0 + c < dv else float32(0.0)
            for r in range(tid, C, NT):
                sc[G, r] = g[c0 + r, h] if r < n else float32(0.0)
                sc[BETA, r] = beta[c0 + r, h] if r < n else float32(0.0)
            cuda.syncthreads()
            for e in range(tid, 3 * C, NT):  # per row: gc and its exponents, then the q and k norms
                if e < C:
                    cumulative_decay(sc, e)
                else:
                    r = (e - C) // 2
                    if (e - C) % 2 == 0:
                        ss = sum_squares(qt, r)
                        sc[QS, r] = float32(scale) / float32(math.sqrt(ss + float32(L2_EPS))) if r < n else float32(0.0)
                    else:
                        ss = sum_squares(kt, r)
                        sc[KS, r] = float32(1.0) / float32(math.sqrt(ss + float32(L2_EPS))) if r < n else float32(0.0)
            cuda.syncthreads()
            for e in range(tid, C * C, NT):  # the Gram products
                i = e // C
                j = e - i * C
                kk = float32(0.0)
                qk = float32(0.0)
                for d in range(DK):
                    kk += kt[i, d] * kt[j, d]
                    qk += qt[i, d] * kt[j, d]
                af[i, j], pt[i, j] = gram_values(sc, i, j, kk, qk)
            cuda.syncthreads()
            solve(af, tf, mf, tid)
            for e in range(tid, C * C, NT):
                i = e // C
                j = e - i * C
                tt[i, j] = tf[i, j] if j <= i else float32(0.0)
            for e in range(tid, C * DVT, NT):  # k S, q S -> the residual and exp(gc) q S
                i = e // DVT
                c = e - i * DVT
                ks = float32(0.0)
                qs = float32(0.0)
                for d in range(DK):
                    ks += kt[i, d] * st[d, c]
                    qs += qt[i, d] * st[d, c]
                rt[i, c] = sc[BETA, i] * (vt[i, c] - sc[EGC, i] * sc[KS, i] * ks)
                ot[i, c] = sc[EGC, i] * sc[QS, i] * qs
            cuda.syncthreads()
            for e in range(tid, C * DVT, NT):  # delta = T residual
                i = e // DVT
                c = e - i * DVT
                x = float32(0.0)
                for j in range(i + 1):
                    x += tt[i, j] * rt[j, c]
                nt[i, c] = x
                dt[i, c] = sc[KS, i] * sc[DL, i] * x
            cuda.syncthreads()
            for e in range(tid, C * DVT, NT):  # o += P delta
                i = e // DVT
                c = e - i * DVT
                o = ot[i, c]
                for j in range(i + 1):
                    o += pt[i, j] * nt[j, c]
                if i < n and j0 + c < dv:
                    out[c0 + i, h, j0 + c] = store(o)
            carried = sc[EGC, C - 1]
            for e in range(tid, DK * DVT, NT):  # S <- exp(gl) S + k^T (exp(gl - gc) delta), in place
                d = e // DVT
                c = e - d * DVT
                x = carried * st[d, c]
                for j in range(C):
                    x += kt[j, d] * dt[j, c]
                st[d, c] = x
            cuda.syncthreads()
        for e in range(tid, DK * DVT, NT):
            d = e // DVT
            c = e - d * DVT
            if j0 + c < dv:
                ssm_state[slot, h, d, j0 + c] = st[d, c]

    return chunked_delta_rule_f32


class _TensorCoreParts:
    """The tensor-core device functions both passes use: staging, the warp-tiled mma products and
    their epilogues. Every function is called by all warps of the block together."""

    def __init__(self, codec: Codec, head_k_dim: int, shape: ChunkShape) -> None:
        C, DK, DVT, NW, NT = shape.chunk, head_k_dim, shape.dv_tile, shape.warps, shape.threads
        load = codec.load
        simulated = simulator_enabled()
        mma = build_mma_bf16()
        pack = build_pack_bf16x2()
        _, _, load_b_x4_trans = build_fragment_loads()
        load_a_x4 = build_a_fragment_load()
        copy_async, _ = build_async_copy()
        rows_c = warp_tiles(C, C, NW)  # the Gram products [C, C]
        rows_v = warp_tiles(C, DVT, NW)  # k S, q S, delta, the output [C, DVT]
        rows_s = warp_tiles(DK, DVT, NW)  # the state [dk, DVT]
        NTC, NTO, NTS = rows_c.n_tiles, rows_v.n_tiles, rows_s.n_tiles
        CM, DM = rows_c.m_tiles, rows_s.m_tiles  # CM: also the k-steps of the products over C
        QK_WORDS = DK // 2
        # Tiles that are zeros by the mask (above the diagonal, past the chunk's rows) are skipped. Where the
        # skip depends on the warp, the simulator still makes the calls and drops their results: its emulated
        # mma needs every warp of a block to make the same calls (and so the skips' conditions are checked).
        DROP_SKIPPED = simulated
        self.gram_values = 4 * NTC  # a lane's accumulators of one Gram product
        self.x_values = 4 * NTO  # of k S, q S, delta or the output
        self.s_values = 4 * NTS  # its state registers

        @cuda.jit(device=True, inline=True)
        def sum_squares(tile, r):
            """sum over a staged bf16 row's dk values squared; each row starts at its own word (r + w), so
            the 32 rows a warp sums at once read 32 banks."""
            even = float32(0.0)
            odd = float32(0.0)
            for w in range(QK_WORDS):
                word = tile[r, (w + r) % QK_WORDS]
                lo = load(word)
                hi = load(word >> 16)
                even += lo * lo
                odd += hi * hi
            return even + odd

        # The staging loops run a constant number of rounds, chunk tid + NT * i in round i: the chunk's
        # index then derives from the thread index alone (non-negative, so // and % by the power-of-two
        # ``chunks`` are a shift and a mask), where a strided range's loop variable would not.
        @cuda.jit(device=True, inline=True)
        def stage(tile, address, src, first, n, col, chunks, tid):
            """Start copying rows first.. first + C - 1 of src's columns col.. (``chunks`` 16-byte chunks a
            row) into tile; zeros from row n on (tid: thread_index())."""
            for i in range(-(-C * chunks // NT)):
                e = tid + NT * i
                if e < C * chunks:
                    r = e // chunks
                    c = e - r * chunks
                    valid = r < n
                    copy_async(tile, address, (r, 4 * c), src, (first + r if valid else first, col + 8 * c), valid)

        @cuda.jit(device=True, inline=True)
        def stage_head_rows(tile, address, src, first, n, h, chunks, tid):
            """Start copying the first ``chunks`` 16-byte chunks of src[first + r, h] (a [T, Hv, words]
            scratch) into tile row r, for r < C; zeros from row n on (tid: thread_index())."""
            for i in range(-(-C * chunks // NT)):
                e = tid + NT * i
                if e < C * chunks:
                    r = e // chunks
                    c = e - r * chunks
                    valid = r < n
                    copy_async(tile, address, (r, 4 * c), src, (first + r if valid else first, h, 4 * c), valid)

        @cuda.jit(device=True, inline=True)
        def mma4(a0, a1, a2, a3, b0, b1, acc, c, keep):
            """acc[c .. c + 3] += A B (one m16n8k16 tile); ``keep`` false (a skipped tile, simulator only)
            drops the result."""
            d0, d1, d2, d3 = mma(a0, a1, a2, a3, b0, b1, acc[c], acc[c + 1], acc[c + 2], acc[c + 3])
            if keep or not DROP_SKIPPED:
                acc[c], acc[c + 1], acc[c + 2], acc[c + 3] = d0, d1, d2, d3

        @cuda.jit(device=True, inline=True)
        def grams(qt, kt, q_lane, k_lane, sc, af, pt, kk, qk, n, warp, g, t, gram_values):
            """k k^T and q k^T of the staged rows -> A (af) and P (pt)."""
            tm = warp % CM
            m0 = 16 * tm
            part = warp // CM
            for x in range(4 * NTC):
                kk[x] = float32(0.0)
                qk[x] = float32(0.0)
            for s in range(DK // 16):
                ka0, ka1, ka2, ka3 = load_a_x4(kt, k_lane, m0, 8 * s)
                qa0, qa1, qa2, qa3 = load_a_x4(qt, q_lane, m0, 8 * s)
                for jn in range(0, NTC, 2):
                    n0 = 8 * (part * NTC + jn)
                    keep = n0 < n and n0 <= m0 + 15  # else columns past the chunk's rows or above the diagonal
                    if not keep and not DROP_SKIPPED:
                        continue
                    # k rows n0.. are n-tile jn, rows n0 + 8.. n-tile jn + 1: A's quarters are their b0, b1.
                    b0, b0_next, b1, b1_next = load_a_x4(kt, k_lane, n0, 8 * s)
                    mma4(ka0, ka1, ka2, ka3, b0, b1, kk, 4 * jn, keep)
                    mma4(ka0, ka1, ka2, ka3, b0_next, b1_next, kk, 4 * jn + 4, keep)
                    mma4(qa0, qa1, qa2, qa3, b0, b1, qk, 4 * jn, keep)
                    mma4(qa0, qa1, qa2, qa3, b0_next, b1_next, qk, 4 * jn + 4, keep)
            for jn in range(NTC):
                n0 = 8 * (part * NTC + jn)
                j = n0 + 2 * t
                for half in range(2):
                    i = m0 + g + 8 * half
                    c = 4 * jn + 2 * half
                    a0, p0 = gram_values(sc, i, j, kk[c], qk[c])
                    a1, p1 = gram_values(sc, i, j + 1, kk[c + 1], qk[c + 1])
                    af[U(i), U(j)] = a0
                    af[U(i), U(j + 1)] = a1
                    pt[U(i), U((n0 >> 1) + t)] = pack(p0, p1)

        @cuda.jit(device=True, inline=True)
        def state_products(qt, kt, q_lane, k_lane, st, s_lane, vt, rs, rt, o, x, warp, g, t):
            """k S -> the residual beta (v - exp(gc) k S / |k|) (rt); q S -> o = exp(gc) q S dk^-0.5 / |q|."""
            m0 = 16 * (warp % CM)
            part = warp // CM
            for e in range(4 * NTO):
                x[e] = float32(0.0)
                o[e] = float32(0.0)
            for s in range(DK // 16):
                ka0, ka1, ka2, ka3 = load_a_x4(kt, k_lane, m0, 8 * s)
                qa0, qa1, qa2, qa3 = load_a_x4(qt, q_lane, m0, 8 * s)
                for jn in range(0, NTO, 2):
                    n0 = 8 * (part * NTO + jn)
                    b0, b1, b2, b3 = load_b_x4_trans(st, s_lane, 16 * s, n0 >> 1)
                    mma4(ka0, ka1, ka2, ka3, b0, b1, x, 4 * jn, True)
                    mma4(ka0, ka1, ka2, ka3, b2, b3, x, 4 * jn + 4, True)
                    mma4(qa0, qa1, qa2, qa3, b0, b1, o, 4 * jn, True)
                    mma4(qa0, qa1, qa2, qa3, b2, b3, o, 4 * jn + 4, True)
            for jn in range(NTO):
                w = ((8 * (part * NTO + jn)) >> 1) + t
                for half in range(2):
                    i = m0 + g + 8 * half
                    c = 4 * jn + 2 * half
                    word = vt[i, w]
                    f = rs[i, ROW_KEY]
                    b = rs[i, ROW_BETA]
                    rt[i, w] = pack(b * (load(word) - f * x[c]), b * (load(word >> 16) - f * x[c + 1]))
                    f = rs[i, ROW_QUERY]
                    o[c] *= f
                    o[c + 1] *= f

        @cuda.jit(device=True, inline=True)
        def transform(tt, t_lane, rt, r_lane, rs, nt, dt, x, n, warp, g, t):
            """delta = T residual -> nt (delta) and dt (exp(gl - gc) delta / |k|)."""
            tm = warp % CM
            m0 = 16 * tm
            part = warp // CM
            for e in range(4 * NTO):
                x[e] = float32(0.0)
            for s in range(CM):
                if 16 * s >= n:
                    continue  # T's columns past the chunk's rows: zeros
                keep = s <= tm  # else above the diagonal: zeros
                if not keep and not DROP_SKIPPED:
                    continue
                ta0, ta1, ta2, ta3 = load_a_x4(tt, t_lane, m0, 8 * s)
                for jn in range(0, NTO, 2):
                    n0 = 8 * (part * NTO + jn)
                    b0, b1, b2, b3 = load_b_x4_trans(rt, r_lane, 16 * s, n0 >> 1)
                    mma4(ta0, ta1, ta2, ta3, b0, b1, x, 4 * jn, keep)
                    mma4(ta0, ta1, ta2, ta3, b2, b3, x, 4 * jn + 4, keep)
            for jn in range(NTO):
                w = ((8 * (part * NTO + jn)) >> 1) + t
                for half in range(2):
                    i = m0 + g + 8 * half
                    c = 4 * jn + 2 * half
                    nt[i, w] = pack(x[c], x[c + 1])
                    f = rs[i, ROW_UPDATE]
                    dt[i, w] = pack(f * x[c], f * x[c + 1])

        @cuda.jit(device=True, inline=True)
        def output(pt, p_lane, nt, n_lane, o, out, c0, n, h, j0, warp, g, t):
            """o += P delta; rows below n to out (bf16 pairs as words)."""
            tm = warp % CM
            m0 = 16 * tm
            part = warp // CM
            for s in range(CM):
                if 16 * s >= n:
                    continue
                keep = s <= tm
                if not keep and not DROP_SKIPPED:
                    continue
                pa0, pa1, pa2, pa3 = load_a_x4(pt, p_lane, m0, 8 * s)
                for jn in range(0, NTO, 2):
                    n0 = 8 * (part * NTO + jn)
                    b0, b1, b2, b3 = load_b_x4_trans(nt, n_lane, 16 * s, n0 >> 1)
                    mma4(pa0, pa1, pa2, pa3, b0, b1, o, 4 * jn, keep)
                    mma4(pa0, pa1, pa2, pa3, b2, b3, o, 4 * jn + 4, keep)
            for jn in range(NTO):
                w = ((j0 + 8 * (part * NTO + jn)) >> 1) + t
                for half in range(2):
                    i = m0 + g + 8 * half
                    c = 4 * jn + 2 * half
                    if i < n:
                        out[c0 + i, h, w] = pack(o[c], o[c + 1])

        @cuda.jit(device=True, inline=True)
        def state_update(kt, k_lane, dt, d_lane, sacc, st, rs, n, warp, g, t):
            """S <- exp(gl) S + k^T dt in the registers, and its bf16 copy in st. k^T's A fragments are
            the transposed loads of the token-major k tile: matrices (tokens, dims) 0-7 x 0-7, 8-15 x 0-7,
            0-7 x 8-15, 8-15 x 8-15 are a0, a2, a1, a3."""
            m0 = 16 * (warp % DM)
            part = warp // DM
            carried = rs[0, ROW_CARRY]
            for e in range(4 * NTS):
                sacc[e] *= carried
            for s in range(CM):
                if 16 * s >= n:
                    continue  # dt's rows past the chunk's rows are zeros
                a0, a2, a1, a3 = load_b_x4_trans(kt, k_lane, 16 * s, m0 >> 1)
                for jn in range(0, NTS, 2):
                    n0 = 8 * (part * NTS + jn)
                    b0, b1, b2, b3 = load_b_x4_trans(dt, d_lane, 16 * s, n0 >> 1)
                    mma4(a0, a1, a2, a3, b0, b1, sacc, 4 * jn, True)
                    mma4(a0, a1, a2, a3, b2, b3, sacc, 4 * jn + 4, True)
            for jn in range(NTS):
                w = ((8 * (part * NTS + jn)) >> 1) + t
                for half in range(2):
                    c = 4 * jn + 2 * half
                    st[m0 + g + 8 * half, w] = pack(sacc[c], sacc[c + 1])

        @cuda.jit(device=True, inline=True)
        def state_access(ssm_state, slot, h, j0, sacc, st, warp, g, t, write):
            """The state tile between ssm_state and this lane's registers (``write``: registers to
            ssm_state; else ssm_state to registers and their bf16 copy to st)."""
            m0 = 16 * (warp % DM)
            part = warp // DM
            for jn in range(NTS):
                n0 = 8 * (part * NTS + jn)
                col = j0 + n0 + 2 * t
                for half in range(2):
                    d = m0 + g + 8 * half
                    c = 4 * jn + 2 * half
                    if write:
                        ssm_state[slot, h, d, col] = sacc[c]
                        ssm_state[slot, h, d, col + 1] = sacc[c + 1]
                    else:
                        sacc[c] = ssm_state[slot, h, d, col]
                        sacc[c + 1] = ssm_state[slot, h, d, col + 1]
                        st[d, (n0 >> 1) + t] = pack(sacc[c], sacc[c + 1])

        self.sum_squares, self.stage, self.stage_head_rows, self.grams = sum_squares, stage, stage_head_rows, grams
        self.state_products, self.transform, self.output = state_products, transform, output
        self.state_update, self.state_access, self.pack = state_update, state_access, pack


def _prepare_kernel(codec: Codec, head_k_dim: int, head_v_dim: int, shape: ChunkShape, tiles: _Tiles, rows: _RowMath,
                    parts: _TensorCoreParts) -> Any:
    """The tensor-core build's first pass: one block per (chunk, value head) computes the chunk's row
    factors, A and P on tensor cores, and T = (I + A)^-1 in float32 (the solve), into the scratch."""
    C, DK, DV, NT = shape.chunk, head_k_dim, head_v_dim, shape.threads
    HALF = C // 2
    scale = float(DK) ** -0.5
    gram_values, cumulative_decay, solve = rows.gram_values, rows.cumulative_decay, rows.solve
    sum_squares, stage, grams, pack = parts.sum_squares, parts.stage, parts.grams, parts.pack
    GRAM_VALUES = parts.gram_values
    QK_CHUNKS = DK // 8
    Q_OFF, q_tile = tiles["q"]
    K_OFF, k_tile = tiles["k"]
    P_OFF, p_tile = tiles["p"]
    A_OFF, a_tile = tiles["a"]
    TF_OFF, tf_tile = tiles["tf"]
    M_OFF, m_tile = tiles["m"]
    SC_OFF, scalars_tile = tiles["scalars"]
    F_OFF, found_tile = tiles["found"]
    ALIGNMENT = None if simulator_enabled() else 16
    lane_address = build_fragment_loads()[0]
    copy_async_wait_all = build_async_copy()[1]
    shared_address = build_shared_address()
    thread_index, block_x, block_y = build_indices()  # non-negative: no sign fix-ups in the index math
    # Two blocks an SM (about 85 KiB of shared memory each at the GPU shape): the solve's barriers
    # leave the SM idle while one block waits.
    launch_options = launch_bounds((NT, 2))

    @cuda.jit(**launch_options)
    def chunked_delta_rule_prepare(qkv, g, beta, q_indptr, slot_ids, transform, gram, scalars):
        words = cuda.shared.array(0, int32, alignment=ALIGNMENT)
        floats = cuda.shared.array(0, float32, alignment=ALIGNMENT)  # the same bytes (dynamic arrays alias)
        qt, kt, pt, found = q_tile(words, Q_OFF), k_tile(words, K_OFF), p_tile(words, P_OFF), found_tile(words, F_OFF)
        af, tf, mf, sc = a_tile(floats, A_OFF), tf_tile(floats, TF_OFF), m_tile(floats, M_OFF), \
            scalars_tile(floats, SC_OFF)
        kk = cuda.local.array(GRAM_VALUES, float32)
        qk = cuda.local.array(GRAM_VALUES, float32)
        tid = thread_index()
        warp = tid // WARP_THREADS
        lane = tid % WARP_THREADS
        g4 = lane // 4
        t4 = lane % 4
        chunk = block_x()
        h = block_y()
        requests = slot_ids.shape[0]
        base = q_indptr[0]
        if tid == 0:
            found[0, 0] = -1
        cuda.syncthreads()
        for r in range(tid, requests, NT):  # the one request whose range of chunk blocks holds this block
            if (q_indptr[r] - base) // C + r <= chunk < (q_indptr[r + 1] - base) // C + r + 1:
                found[0, 0] = r
        cuda.syncthreads()
        req = found[0, 0]
        if req < 0:
            return
        start = q_indptr[req]
        end = q_indptr[req + 1]
        c0 = start + (chunk - (start - base) // C - req) * C
        if c0 >= end or slot_ids[req] < 0:  # uniform over the block: nobody waits at a barrier
            return
        n = min(C, end - c0)
        q_col, k_col, _ = qkv_columns(qkv.shape[1], scalars.shape[1], DK, DV, h)
        stage(qt, shared_address(qt, (0, 0)), qkv, c0, n, q_col, QK_CHUNKS, tid)
        stage(kt, shared_address(kt, (0, 0)), qkv, c0, n, k_col, QK_CHUNKS, tid)
        for r in range(tid, C, NT):
            sc[G, r] = g[c0 + r, h] if r < n else float32(0.0)
            sc[BETA, r] = beta[c0 + r, h] if r < n else float32(0.0)
        copy_async_wait_all()
        cuda.syncthreads()
        for e in range(tid, 3 * C, NT):  # per row: gc and its exponents, then the q and k norms
            if e < C:
                cumulative_decay(sc, e)
            else:
                r = (e - C) // 2
                if (e - C) % 2 == 0:
                    ss = sum_squares(qt, r)
                    sc[QS, r] = float32(scale) / float32(math.sqrt(ss + float32(L2_EPS))) if r < n else float32(0.0)
                else:
                    ss = sum_squares(kt, r)
                    sc[KS, r] = float32(1.0) / float32(math.sqrt(ss + float32(L2_EPS))) if r < n else float32(0.0)
        cuda.syncthreads()
        grams(qt, kt, lane_address(qt, True), lane_address(kt, True), sc, af, pt, kk, qk, n, warp, g4, t4,
              gram_values)
        cuda.syncthreads()
        solve(af, tf, mf, tid)
        for e in range(tid, n * HALF, NT):  # T and P rows as bf16 pairs, zeros above the diagonal
            i = e // HALF
            w = e - i * HALF
            j = 2 * w
            lo = tf[U(i), U(j)] if j <= i else float32(0.0)
            hi = tf[U(i), U(j + 1)] if j + 1 <= i else float32(0.0)
            transform[U(c0 + i), U(h), U(w)] = pack(lo, hi)
            gram[U(c0 + i), U(h), U(w)] = pt[U(i), U(w)] if j <= i else int32(0)
        carried = sc[EGC, C - 1]  # exp(gl): rows past n add 0 to gc
        for i in range(tid, n, NT):
            ks = sc[KS, i]
            scalars[c0 + i, h, ROW_BETA] = sc[BETA, i]
            scalars[c0 + i, h, ROW_KEY] = sc[EGC, i] * ks
            scalars[c0 + i, h, ROW_QUERY] = sc[EGC, i] * sc[QS, i]
            scalars[c0 + i, h, ROW_UPDATE] = sc[DL, i] * ks
            scalars[c0 + i, h, ROW_CARRY] = carried

    return chunked_delta_rule_prepare


def _scan_kernel(codec: Codec, head_k_dim: int, shape: ChunkShape, tiles: _Tiles, parts: _TensorCoreParts) -> Any:
    """The tensor-core build's second pass: one block per (dv tile, value head, request) walks the
    request's chunks in order, the state tile in registers; a chunk's inputs (q, k, v, T, P, the row
    factors) are copied into one of two buffers while the chunk before runs on the other."""
    C, DK, DVT, NT = shape.chunk, head_k_dim, shape.dv_tile, shape.threads
    stage, stage_head_rows = parts.stage, parts.stage_head_rows
    state_products, apply_transform, output = parts.state_products, parts.transform, parts.output
    state_update, state_access = parts.state_update, parts.state_access
    X_VALUES, S_VALUES = parts.x_values, parts.s_values
    QK_CHUNKS, V_CHUNKS, C_CHUNKS, ROW_CHUNKS = DK // 8, DVT // 8, C // 8, ROW_SCALARS // 4
    Q_OFF, q_tile = tiles["q"]
    K_OFF, k_tile = tiles["k"]
    V_OFF, v_tile = tiles["v"]
    T_OFF, t_tile = tiles["t"]
    P_OFF, p_tile = tiles["p"]
    RS_OFF, rows_tile = tiles["rows"]
    S_OFF, s_tile = tiles["s"]
    R_OFF, r_tile = tiles["r"]
    N_OFF, n_tile = tiles["n"]
    D_OFF, d_tile = tiles["d"]
    STRIDE = tiles.stride  # words from one buffer's tiles to the other's
    ALIGNMENT = None if simulator_enabled() else 16
    lane_address = build_fragment_loads()[0]
    shared_address = build_shared_address()
    BUFFERS = shape.buffers
    commit_group, wait_groups = build_copy_groups(BUFFERS - 1)
    thread_index, block_x, block_y = build_indices()  # non-negative: no sign fix-ups in the index math
    # Two buffers: one block an SM (they take most of its shared memory), all its registers the block's;
    # one buffer: two blocks an SM.
    launch_options = launch_bounds((NT, 3 - BUFFERS))

    @cuda.jit(device=True, inline=True)
    def stage_chunk(words, floats, buffer, qkv, transform, gram, scalars, c0, n, q_col, k_col, v_col, h, tid):
        """Start copying chunk c0's inputs into ``buffer`` (0 or 1) and close them into one group."""
        at = buffer * STRIDE
        qt, kt, vt = q_tile(words, Q_OFF + at), k_tile(words, K_OFF + at), v_tile(words, V_OFF + at)
        tt, pt, rs = t_tile(words, T_OFF + at), p_tile(words, P_OFF + at), rows_tile(floats, RS_OFF + at)
        stage(qt, shared_address(qt, (0, 0)), qkv, c0, n, q_col, QK_CHUNKS, tid)
        stage(kt, shared_address(kt, (0, 0)), qkv, c0, n, k_col, QK_CHUNKS, tid)
        stage(vt, shared_address(vt, (0, 0)), qkv, c0, n, v_col, V_CHUNKS, tid)
        stage_head_rows(tt, shared_address(tt, (0, 0)), transform, c0, n, h, C_CHUNKS, tid)
        stage_head_rows(pt, shared_address(pt, (0, 0)), gram, c0, n, h, C_CHUNKS, tid)
        stage_head_rows(rs, shared_address(rs, (0, 0)), scalars, c0, n, h, ROW_CHUNKS, tid)
        commit_group()

    @cuda.jit(**launch_options)
    def chunked_delta_rule_scan(qkv, ssm_state, q_indptr, slot_ids, transform, gram, scalars, out):
        words = cuda.shared.array(0, int32, alignment=ALIGNMENT)
        floats = cuda.shared.array(0, float32, alignment=ALIGNMENT)  # the same bytes (dynamic arrays alias)
        st, rt, nt, dt = s_tile(words, S_OFF), r_tile(words, R_OFF), n_tile(words, N_OFF), d_tile(words, D_OFF)
        o = cuda.local.array(X_VALUES, float32)
        x = cuda.local.array(X_VALUES, float32)
        sacc = cuda.local.array(S_VALUES, float32)
        tid = thread_index()
        warp = tid // WARP_THREADS
        lane = tid % WARP_THREADS
        g4 = lane // 4
        t4 = lane % 4
        j0 = block_x() * DVT
        h = block_y()
        req = cuda.blockIdx.z
        start = q_indptr[req]
        end = q_indptr[req + 1]
        slot = slot_ids[req]
        if end == start or slot < 0:  # uniform over the block: nobody waits at a barrier
            return
        v_heads = ssm_state.shape[1]
        dv = ssm_state.shape[3]
        q_col, k_col, v_col = qkv_columns(qkv.shape[1], v_heads, DK, dv, h)
        v_col += j0
        s_lane, r_lane = lane_address(st, True), lane_address(rt, True)
        n_lane, d_lane = lane_address(nt, True), lane_address(dt, True)
        stage_chunk(words, floats, 0, qkv, transform, gram, scalars, start, min(C, end - start), q_col, k_col, v_col,
                    h, tid)
        state_access(ssm_state, slot, h, j0, sacc, st, warp, g4, t4, False)
        buffer = 0
        for c0 in range(start, end, C):
            n = min(C, end - c0)
            c_next = c0 + C
            if BUFFERS == 2:
                if c_next < end:  # the other buffer's last reader passed the previous round's last barrier
                    stage_chunk(words, floats, 1 - buffer, qkv, transform, gram, scalars, c_next,
                                min(C, end - c_next), q_col, k_col, v_col, h, tid)
                else:
                    commit_group()  # an empty group: the wait below always leaves the newest one in flight
            wait_groups()
            cuda.syncthreads()  # this chunk's inputs (and, first, the state tile) are in
            at = buffer * STRIDE
            qt, kt, vt = q_tile(words, Q_OFF + at), k_tile(words, K_OFF + at), v_tile(words, V_OFF + at)
            tt, pt, rs = t_tile(words, T_OFF + at), p_tile(words, P_OFF + at), rows_tile(floats, RS_OFF + at)
            k_lane = lane_address(kt, True)
            state_products(qt, kt, lane_address(qt, True), k_lane, st, s_lane, vt, rs, rt, o, x, warp, g4, t4)
            cuda.syncthreads()
            apply_transform(tt, lane_address(tt, True), rt, r_lane, rs, nt, dt, x, n, warp, g4, t4)
            cuda.syncthreads()
            output(pt, lane_address(pt, True), nt, n_lane, o, out, c0, n, h, j0, warp, g4, t4)
            state_update(kt, k_lane, dt, d_lane, sacc, st, rs, n, warp, g4, t4)
            cuda.syncthreads()  # this buffer is read and st holds the new state
            if BUFFERS == 1 and c_next < end:
                stage_chunk(words, floats, 0, qkv, transform, gram, scalars, c_next, min(C, end - c_next), q_col,
                            k_col, v_col, h, tid)
            buffer = (buffer + 1) % BUFFERS
        state_access(ssm_state, slot, h, j0, sacc, st, warp, g4, t4, True)

    return chunked_delta_rule_scan


def default_shapes(tensor_cores: bool) -> tuple[ChunkShape, ChunkShape | None]:
    """(shape, narrow scan shape): SIMULATOR_SHAPE in the simulator; on the GPU, GPU_SHAPE and
    GPU_NARROW_SHAPE (tensor cores) or GPU_FLOAT32_SHAPE."""
    if simulator_enabled():
        return SIMULATOR_SHAPE, None
    return (GPU_SHAPE, GPU_NARROW_SHAPE) if tensor_cores else (GPU_FLOAT32_SHAPE, None)


def narrow_scan(wide_blocks: int, num_sms: int) -> bool:
    """Whether a scan of ``wide_blocks`` blocks of the wide shape runs the narrow shape instead: when
    the wide grid leaves at least CHUNKED_DELTA_RULE_NARROW_SCAN_SMS_PER_BLOCK SMs a block."""
    return wide_blocks * CHUNKED_DELTA_RULE_NARROW_SCAN_SMS_PER_BLOCK <= num_sms


@dataclass(frozen=True)
class ChunkScratch:
    """The tensor-core build's planned per-row scratch (the prefill pool's delta_transform, delta_gram
    and delta_scalars): transform and gram [rows, Hv, >= C] bf16, scalars [rows, Hv, ROW_SCALARS]
    float32, rows >= the step's."""

    transform: Any
    gram: Any
    scalars: Any


class ChunkedGatedDeltaRule:
    """Launcher of the chunked gated delta rule; ``ssm_state`` is updated in place.

    Same arguments as ``GatedDeltaRule.__call__`` (delta_rule.py): qkv [T, 2 Hk dk + Hv dv] storage
    dtype; g, beta [T, Hv] float32; ssm_state [slots, Hv, dk, dv] float32; q_indptr [B + 1], slot_ids
    [B] int32 (slots distinct; -1 skipped); out [T, Hv, dv] storage dtype, not aliasing qkv; plus, for
    the tensor-core build, ``scratch`` (ChunkScratch). Rows of a request may be any number.

    bf16 storage runs the tensor-core build (two launches: prepare, then scan), any other the
    float32 build (one launch, no scratch). ``shape`` (default ``default_shapes(...)``): the block's
    chunk, state columns, warps and solve block. ``narrow_shape`` (the default's on the GPU's tensor
    cores, else none unless given): the scan's shape where ``shape``'s scan grid would leave SMs idle
    (``narrow_scan``); it differs from ``shape`` only in state columns and buffers, so both scans
    take the one prepare pass. The first call readies both scans (warm-up compiles or loads them, a
    discovery pass lists them). The tensor-core build needs 16-byte aligned qkv rows and dv a
    multiple of the dv tile; a call whose qkv is not so aligned runs ``fallback`` (the recurrent
    launcher) instead, with identical semantics.
    """

    def __init__(self, codec: Codec, head_k_dim: int, fallback: GatedDeltaRule | None = None,
                 shape: ChunkShape | None = None, narrow_shape: ChunkShape | None = None) -> None:
        self.codec, self.head_k_dim = codec, head_k_dim
        self.tensor_cores = codec.torch_dtype_name == "bfloat16"
        if shape is None:
            shape, default_narrow = default_shapes(self.tensor_cores)
            narrow_shape = narrow_shape or default_narrow
        self.shape, self.narrow_shape = shape, narrow_shape if self.tensor_cores else None
        check_shape(head_k_dim, shape, self.tensor_cores)
        if self.narrow_shape is not None:
            check_shape(head_k_dim, self.narrow_shape, self.tensor_cores)
            if (self.narrow_shape.chunk, self.narrow_shape.warps, self.narrow_shape.solve_block) != \
                    (shape.chunk, shape.warps, shape.solve_block):
                raise ValueError(f"chunked delta rule: the narrow scan shape {self.narrow_shape} must share the "
                                 f"chunk, warps and solve block of {shape} (one prepare pass serves both)")
        self.fallback = fallback
        self.num_sms = 0  # asked on the first tensor-core call
        # (dv, shape) -> (the dv-fitted shape, ((kernel, shared bytes) per launch))
        self.kernels: dict[tuple[int, ChunkShape], tuple[ChunkShape, tuple[tuple[Kernel, int], ...]]] = {}
        self.readied: set[int] = set()  # dv whose scans are both ready

    def kernel(self, dv: int, shape: ChunkShape | None = None) -> tuple[ChunkShape, tuple[tuple[Kernel, int], ...]]:
        """The block shape and, per launch, the kernel and its dynamic shared bytes for value heads of
        ``dv`` at ``shape`` (default the launcher's shape; built once)."""
        requested = shape or self.shape
        entry = self.kernels.get((dv, requested))
        if entry is None:
            shape = requested
            if shape.dv_tile > dv:  # one tile covers the head
                shape = ChunkShape(shape.chunk, dv, shape.warps, shape.solve_block, shape.buffers)
            if self.tensor_cores and dv % shape.dv_tile:
                raise ValueError(f"chunked delta rule: dv {dv} must be a multiple of the dv tile {shape.dv_tile}")
            check_shape(self.head_k_dim, shape, self.tensor_cores)
            layouts = shared_layouts(self.head_k_dim, shape, self.tensor_cores)
            built = build_chunked_delta_rule(self.codec, self.head_k_dim, dv, shape, self.tensor_cores)
            launches = tuple((Kernel(function, dynamic_shared_bytes=layout.bytes), layout.bytes)
                             for function, layout in zip(built, layouts))
            entry = self.kernels[(dv, requested)] = (shape, launches)
        return entry

    def scan(self, dv: int, shape: ChunkShape) -> tuple[ChunkShape, Kernel, int]:
        """The scan of ``kernel(dv, shape)``: its dv-fitted shape, kernel and dynamic shared bytes."""
        fitted, (_, (scan, shared)) = self.kernel(dv, shape)
        return fitted, scan, shared

    def scan_shape(self, dv: int, v_heads: int, requests: int) -> ChunkShape:
        """The shape whose scan serves a call (``narrow_scan`` between the launcher's two)."""
        if self.narrow_shape is None:
            return self.shape
        if not self.num_sms:
            self.num_sms = multiprocessor_count()
        wide_blocks = -(-dv // self.shape.dv_tile) * v_heads * requests
        return self.narrow_shape if narrow_scan(wide_blocks, self.num_sms) else self.shape

    def __call__(self, qkv: Any, g: Any, beta: Any, ssm_state: Any, q_indptr: Any, slot_ids: Any, out: Any,
                 scratch: ChunkScratch | None = None, stream: Any = 0) -> None:
        for _, launch in self.launches(qkv, g, beta, ssm_state, q_indptr, slot_ids, out, scratch, stream):
            launch()

    def launches(self, qkv: Any, g: Any, beta: Any, ssm_state: Any, q_indptr: Any, slot_ids: Any, out: Any,
                 scratch: ChunkScratch | None = None, stream: Any = 0) -> list[tuple[str, Callable[[], None]]]:
        """The call's launches in order, each as (name, launch): ``prepare`` then ``scan`` on tensor cores,
        ``chunked`` for the float32 build, ``recurrent`` for the fallback, none for an empty call.
        ``__call__`` runs them; bench/delta_rule.py times them apart."""
        v_heads, dv, requests = check_delta_rule_shapes(qkv, g, beta, ssm_state, q_indptr, slot_ids, out,
                                                        self.head_k_dim)
        if requests == 0 or int(qkv.shape[0]) == 0:
            return []
        if self.tensor_cores and not vector_aligned(qkv):
            if self.fallback is None:
                raise ValueError("chunked delta rule: qkv rows must be 16-byte aligned and contiguous")
            fallback = self.fallback
            return [("recurrent", lambda: fallback(qkv, g, beta, ssm_state, q_indptr, slot_ids, out, stream=stream))]
        shape, launches = self.kernel(dv)
        if not self.tensor_cores:
            (kernel, shared), = launches
            launch = kernel[(-(-dv // shape.dv_tile), v_heads, requests), shape.threads, stream, shared]
            return [("chunked", lambda: launch(qkv, g, beta, ssm_state, q_indptr, slot_ids, out))]
        transform, gram, scalars = self.check_scratch(scratch, int(qkv.shape[0]), v_heads, shape.chunk)
        (prepare, prepare_shared), _ = launches
        prepare_launch = prepare[(int(qkv.shape[0]) // shape.chunk + requests, v_heads), shape.threads, stream,
                                 prepare_shared]
        scan_args = (qkv, ssm_state, q_indptr, slot_ids, transform, gram, scalars, as_words(out))
        if dv not in self.readied:  # both scans, so a later step of another request count compiles nothing
            for ready in {self.shape, self.narrow_shape} - {None}:
                self.scan(dv, ready)[1].prepare(*scan_args)
            self.readied.add(dv)
        scan_shape, scan, scan_shared = self.scan(dv, self.scan_shape(dv, v_heads, requests))
        scan_launch = scan[(dv // scan_shape.dv_tile, v_heads, requests), scan_shape.threads, stream, scan_shared]
        return [("prepare", lambda: prepare_launch(qkv, g, beta, q_indptr, slot_ids, transform, gram, scalars)),
                ("scan", lambda: scan_launch(*scan_args))]

    @staticmethod
    def check_scratch(scratch: ChunkScratch | None, rows: int, v_heads: int, chunk: int) -> tuple[Any, Any, Any]:
        """The scratch as the kernels take it (transform and gram as int32 words); ValueError unless it
        holds ``rows`` rows of ``v_heads`` heads, ``chunk`` values a row."""
        if scratch is None:
            raise ValueError("chunked delta rule: the tensor-core build needs its ChunkScratch (the plan's "
                             "delta_transform, delta_gram and delta_scalars)")
        for name in ("transform", "gram", "scalars"):
            array = getattr(scratch, name)
            width = ROW_SCALARS if name == "scalars" else chunk
            if len(array.shape) != 3 or int(array.shape[0]) < rows or int(array.shape[1]) != v_heads \
                    or int(array.shape[2]) < width:
                raise ValueError(f"chunked delta rule: scratch {name} {tuple(array.shape)} must be [>= {rows}, "
                                 f"{v_heads}, >= {width}]")
        return as_words(scratch.transform), as_words(scratch.gram), scratch.scalars
