"""The split-KV merge: combine the partial outputs of a row's kv chunks into its attention output.

The split attention kernels (paged.py, decode.py, decode_mma.py) write each chunk's normalised
partial output and log-sum-exp into the plan's float32 scratch ``partial_out [T, depth, Hq, D]``
/ ``partial_lse [T, depth, Hq]`` for rows of more than one chunk, and rows of one chunk straight
to ``out``. One launch (grid T x Hq, threads over D) then merges the split rows:
``out[t, h] = sum_c w_c partial_out[t, c, h] / sum_c w_c``, ``w_c = exp(lse_c - max_c lse)``.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.indices import build_indices
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import threads_for
from executor.numba_cuda import load_cuda
from executor.routing import MERGE_SPECULATE_MAX_ROWS
from planner.kernel_limits import MAX_DECODE_KV_SPLITS

cuda = load_cuda()
from numba import float32, int32, uint64  # noqa: E402  (after load_cuda's numpy fix)

NEG_INF = float32(-np.inf)
MERGE_UNROLL = 16  # chunk partials a merge thread loads before adding any (512 tokens in chunks of 64: one trip)
MAX_MERGE_CHUNKS = MAX_DECODE_KV_SPLITS  # deepest split scratch the merge takes: the plan's decode_kv_splits bound


def merge_threads(head_dim: int) -> int:
    """Threads a block of the merge kernel: one output element of a head a thread."""
    return threads_for(head_dim)


def build_merge_kernel(codec: Codec, head_dim: int) -> Any:
    """The merge kernel for one codec (the output's storage) and head_dim (compile-time)."""
    D = head_dim
    MERGE_THREADS = merge_threads(D)
    store = codec.store
    thread_index, block_x, block_y = build_indices()

    @cuda.jit(device=True, inline=True)
    def stage_first_round(partial_flat, partial_lse, t, head, num_chunks, row_base, chunk_stride, values, lse_sh):
        """A thread's first MERGE_UNROLL chunk partials (those < num_chunks: guarded, not clamped) into
        ``values`` and the log-sum-exps of chunks < num_chunks into ``lse_sh``; partial_flat[row_base +
        c chunk_stride + d] is element d of chunk c's partial (merge_kernel)."""
        first_d = thread_index()
        if first_d < D:
            for u in range(MERGE_UNROLL):
                if u < num_chunks:
                    values[u] = partial_flat[row_base + uint64(first_d) + uint64(u) * chunk_stride]
        c = thread_index()  # strided loops as while loops: a strided range() divides (64-bit) for its trip count
        while c < num_chunks:
            lse_sh[c] = partial_lse[t, c, head]
            c += MERGE_THREADS

    @cuda.jit
    def merge_kernel(partial_flat, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out):
        """Grid (T, Hq), threads over D: out[t, h] = sum_c w_c partial_out[t, c, h] for split rows,
        w_c = exp(lse_c - max lse) / sum. Rows with one chunk were written by split_kernel.

        ``partial_flat`` is partial_out [T, depth, Hq, D] as one flat float32 array (the launcher's
        view): a thread's chunk partials then lie a constant stride apart from one base offset, one
        multiply-add a load, where 4-d indexing recomputes every load's whole offset from the runtime
        shapes (about 25 instructions a load, ahead of the loads).

        At decode sizes a warp of this kernel has an SM scheduler to itself: it takes about as long
        as its instructions' dependent latencies, so each thread does as little as it can. In a launch
        of at most MERGE_SPECULATE_MAX_ROWS rows every load of the first round goes out together,
        before the row's chunk count is known: the row's metadata (t < T, so its entries are valid
        addresses even past the step's rows), a thread's first MERGE_UNROLL chunk partials and the
        log-sum-exps of every chunk the scratch holds (its whole depth; only chunks < num_chunks are
        used): one dependent round where waiting for the chunk count takes two. A larger launch
        waits: most of its rows are not split, and their blocks would load bytes nobody uses.
        Either way the chunk size of request t goes out with the metadata: at decode it is the row's
        own (a row a request), and a row of another request looks its request's up again.
        Chunk c's weight exp(lse_c - max) is computed once, by thread c, into shared memory (not by
        every thread for every chunk); a thread then adds MERGE_UNROLL partials at a time.
        Sums run in chunk order, and a thread multiplies by the reciprocal of the weight sum once
        computed: a division per output can take the division's slow path (as decode_tiles.py's meet
        did on an all-zero V)."""
        lse_sh = cuda.shared.array(MAX_MERGE_CHUNKS, float32)
        weight_sh = cuda.shared.array(MAX_MERGE_CHUNKS, float32)
        values = cuda.local.array(MERGE_UNROLL, float32)
        t = block_x()
        head = block_y()
        depth = partial_lse.shape[1]
        num_heads = out.shape[1]
        # Unsigned flat indices: Numba wraps a signed index that might be negative (a compare and a
        # select on 64 bits a load), and no product of the shapes is known to be >= 0.
        chunk_stride = uint64(num_heads * D)
        row_base = uint64((t * depth * num_heads + head) * D)
        speculate = cuda.gridDim.x <= MERGE_SPECULATE_MAX_ROWS
        step_rows = int32(total_num_rows[0])
        position = positions[t]
        b = batch_indices[t]
        chunk = kv_chunk_size[min(t, kv_chunk_size.shape[0] - 1)]
        if speculate:
            stage_first_round(partial_flat, partial_lse, t, head, depth, row_base, chunk_stride, values, lse_sh)
        if t >= step_rows:
            return
        if b != t:
            chunk = kv_chunk_size[b]
        num_chunks = min(position // chunk + 1, depth)
        if num_chunks <= 1:
            return
        if not speculate:
            stage_first_round(partial_flat, partial_lse, t, head, num_chunks, row_base, chunk_stride, values,
                              lse_sh)
        cuda.syncthreads()
        top = NEG_INF
        for c in range(num_chunks):
            top = max(top, lse_sh[c])
        c = thread_index()
        while c < num_chunks:
            weight_sh[c] = float32(math.exp(lse_sh[c] - top))
            c += MERGE_THREADS
        cuda.syncthreads()
        weight_sum = float32(0.0)
        for c in range(num_chunks):
            weight_sum += weight_sh[c]
        inv_weight_sum = float32(1.0) / weight_sum  # >= 1: the largest weight is 1
        first_d = thread_index()
        d = first_d
        while d < D:
            total = float32(0.0)
            for c0 in range(0, num_chunks, MERGE_UNROLL):
                if d != first_d or c0 > 0:
                    for u in range(MERGE_UNROLL):
                        if c0 + u < num_chunks:
                            values[u] = partial_flat[row_base + uint64(d) + uint64(c0 + u) * chunk_stride]
                for u in range(MERGE_UNROLL):
                    if c0 + u < num_chunks:
                        total += weight_sh[c0 + u] * values[u]
            out[t, head, d] = store(total * inv_weight_sum)
            d += MERGE_THREADS

    return merge_kernel


class SplitMerge:
    """Launcher of the split-KV merge for one codec and head_dim; allocates nothing."""

    def __init__(self, codec: Codec, head_dim: int) -> None:
        self.head_dim = head_dim
        self.kernel = Kernel(build_merge_kernel(codec, head_dim))

    def __call__(self, partial_out: Any, partial_lse: Any, batch_indices: Any, positions: Any,
                 kv_chunk_size: Any, total_num_rows: Any, out: Any, stream: Any = 0) -> None:
        """Combine split rows' partials into ``out [T, Hq, D]`` (one launch, grid T x Hq); the split
        kernel wrote rows of one chunk straight to ``out``."""
        num_rows, num_q_heads = out.shape[0], out.shape[1]
        if partial_out.shape[1] > MAX_MERGE_CHUNKS:
            raise ValueError(f"attention merge: split scratch of {partial_out.shape[1]} kv chunks, the merge takes "
                             f"at most {MAX_MERGE_CHUNKS}")
        # The merge reads the partials flat. A view, never a copy (the planned scratch is contiguous, and
        # torch's view refuses otherwise); the tests' host arrays reshape.
        flat = partial_out.view(-1) if isinstance(partial_out, torch.Tensor) else partial_out.reshape(-1)
        self.kernel[(num_rows, num_q_heads), merge_threads(self.head_dim), stream](
            flat, partial_lse, batch_indices, positions, kv_chunk_size, total_num_rows, out
        )
