"""The merge of a split decode row inside the attention kernel: the row's last tile to finish merges.

A decode step splits a long row's keys into kv chunks, one block (tile) each, and attention.py's
merge launch then combined the chunks' partial outputs. At batch 1 that launch is one more link in
the layer's chain of dependent kernels: 3.9 us a layer of a Qwen3-8B decode step on the H200
(docs/benchmarks.md, twenty-first session), for a few kilobytes of work. Here every tile of a split
row, once its partial is in global memory, counts itself in ``merge_counters[row, h]``; the tile
that counts last has every other tile's partial visible, merges the row's G heads of kv head h and
sets the counter back to zero for the next launch (the plan's decode pool keeps the counters for
the whole step, and the executor zeroes them once, before the first step).

    merge_split(out, partial_out, partial_lse, merge_counters, row, num_chunks, h, lse_sh, flag_sh)
        every thread of a tile of a row of ``num_chunks`` > 1 chunks, after the tile's
        ``store_split`` (decode_tiles.py): the last tile writes ``out[row, h G + g, :]`` for its
        G heads. ``lse_sh`` is [G, MAX_MERGE_CHUNKS] float32 shared memory, ``flag_sh`` one
        int32; ends with every thread of a tile that does not merge returning at once.

Ordering: the tile's threads store their partials, a barrier orders those stores before thread 0's
``threadfence`` (release at device scope), and thread 0's atomic add then counts the tile; the
tile that reads the last count fences again (acquire) before a barrier hands the result to its
threads. They read the partials with ``ld.global.cg`` (L2), not through their SM's L1, which may
hold lines of a partial_lse row that another tile of this launch merged before the other heads'
entries landed.

The arithmetic is attention.py's ``merge_kernel``, in its order (chunk order, the weight of chunk
c ``exp(lse_c - max lse)`` in float32, the division last): the output is the merge launch's, bit for
bit (tests/kernels/test_decode_attention.py).
"""

from __future__ import annotations

import math
from typing import Any

from executor.kernels.attention import MAX_MERGE_CHUNKS, NEG_INF
from executor.numba_cuda import load_cuda, simulator_enabled

cuda = load_cuda()
from numba import float32, int32  # noqa: E402  (after load_cuda's numpy fix)

#: Chunk partials a thread loads for each of its outputs before adding any: a batch-1 row of 512
#: tokens in chunks of 64 is one trip.
MERGE_UNROLL = 8


def merge_shared_words(group_size: int) -> int:
    """Shared memory (4-byte words) merge_split's arrays add to a block: lse_sh and flag_sh."""
    return group_size * MAX_MERGE_CHUNKS + 1


def check_merge_counters(name: str, merge_counters: Any, num_rows: int, num_kv_heads: int) -> None:
    """A split launch's counters must be int32 with a counter per (row, kv head); the launcher's caller
    passes the plan's ``attn_merge_counters`` (a wrong one is a bug, named here, not a config error)."""
    shape = None if merge_counters is None else tuple(int(n) for n in merge_counters.shape)
    if shape is None or len(shape) != 2 or shape[0] < num_rows or shape[1] != num_kv_heads \
            or str(merge_counters.dtype) not in ("int32", "torch.int32"):
        raise ValueError(f"{name}: split tiles merge in the kernel and need int32 merge_counters of at least "
                         f"[{num_rows}, {num_kv_heads}] (rows, kv heads), got "
                         f"{None if shape is None else (shape, str(merge_counters.dtype))}")


def build_coherent_load() -> Any:
    """``load_l2(array, index)``: array[index] read from L2 (``ld.global.cg``); a plain read in the
    simulator, which has no caches."""
    if simulator_enabled():
        @cuda.jit(device=True)
        def plain(array, index):
            return array[index]

        return plain

    @cuda.jit(device=True, inline=True)
    def load_l2(array, index):
        return cuda.ldcg(array, index)

    return load_l2


def build_tile_merge(group_size: int, head_dim: int, threads: int, store: Any) -> Any:
    """``merge_split`` (module docstring) for blocks of ``threads`` threads, G = ``group_size`` heads of
    ``head_dim``; ``store`` is the codec's float32 -> storage.

    Thread t < G (NT // G) merges head g = t // (NT // G), elements d = t % (NT // G) + o (NT // G):
    one head a thread, so its max and weight sum are scalars and its outputs' partials sit in
    registers (every loop over them has a constant trip count)."""
    G, D, NT, U = group_size, head_dim, threads, MERGE_UNROLL
    TPG = NT // G  # threads a head
    OUTPUTS = -(-D // TPG)  # elements of the head a thread merges
    VALUES = OUTPUTS * U  # a thread's partials in flight
    load_l2 = build_coherent_load()

    @cuda.jit(device=True, inline=True)
    def arrive(merge_counters, row, h, num_chunks, flag_sh):
        """Count this tile; True in every thread of the tile that counted last."""
        cuda.syncthreads()  # every thread's partial stores come before thread 0's fence
        if cuda.threadIdx.x == 0:
            cuda.threadfence()
            last = cuda.atomic.add(merge_counters, (row, h), 1) == num_chunks - 1
            if last:
                merge_counters[row, h] = 0  # no tile of this launch counts again
                cuda.threadfence()
            flag_sh[0] = int32(1) if last else int32(0)
        cuda.syncthreads()
        return flag_sh[0] != 0

    @cuda.jit(device=True, inline=True)
    def merge_split(out, partial_out, partial_lse, merge_counters, row, num_chunks, h, lse_sh, flag_sh):
        if not arrive(merge_counters, row, h, num_chunks, flag_sh):
            return
        tid = cuda.threadIdx.x
        g = min(tid // TPG, G - 1)  # threads past G TPG load for head G - 1 and store nothing
        first_d = tid % TPG
        head = h * G + g
        chunks = min(num_chunks, partial_out.shape[1])  # the merge launch's clamp to the scratch depth
        values = cuda.local.array(VALUES, float32)
        totals = cuda.local.array(OUTPUTS, float32)
        for o in range(OUTPUTS):  # the first trip's partials, in flight while the lse round lands
            d = min(first_d + o * TPG, D - 1)
            for u in range(U):  # clamped: a valid address; only chunks < chunks are added
                values[o * U + u] = load_l2(partial_out, (row, min(u, chunks - 1), head, d))
        i = tid
        while i < G * chunks:  # strided loops as while loops (a strided range() divides in 64 bits)
            lse_g = i // chunks
            lse_sh[lse_g, i - lse_g * chunks] = load_l2(partial_lse, (row, i - lse_g * chunks, h * G + lse_g))
            i += NT
        cuda.syncthreads()
        top = NEG_INF
        for c in range(chunks):
            top = max(top, lse_sh[g, c])
        weight_sum = float32(0.0)
        for c in range(chunks):
            weight_sum += float32(math.exp(lse_sh[g, c] - top))
        for o in range(OUTPUTS):
            totals[o] = float32(0.0)
        c0 = 0
        while c0 < chunks:
            if c0 > 0:
                for o in range(OUTPUTS):
                    d = min(first_d + o * TPG, D - 1)
                    for u in range(U):
                        values[o * U + u] = load_l2(partial_out, (row, min(c0 + u, chunks - 1), head, d))
            for u in range(U):
                if c0 + u < chunks:
                    weight = float32(math.exp(lse_sh[g, c0 + u] - top))
                    for o in range(OUTPUTS):
                        totals[o] += weight * values[o * U + u]
            c0 += U
        if tid < G * TPG:
            for o in range(OUTPUTS):
                d = first_d + o * TPG
                if d < D:
                    out[row, head, d] = store(totals[o] / weight_sum)

    return merge_split
