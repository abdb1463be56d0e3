"""Causal depthwise conv1d + SiLU over a batch of requests, with the per-slot conv state.

Qwen3.5's Gated DeltaNet runs ``in_proj_qkv``'s output through a depthwise
causal convolution (kernel K = 4, no bias), then SiLU. HF (``causal_conv1d_fn``
/ ``causal_conv1d_update``) computes, per channel c and output row t of a
request whose earlier inputs are kept in its conv state::

    xfull = [conv_state[slot, c, 0 .. K-2] ; x[rows of the request, c]]
    out[t, c] = silu(sum_i weight[c, i] * xfull[t + i])     (cross-correlation)
    conv_state[slot, c, :] <- the last K-1 entries of xfull

so a request continues exactly across prefill chunks of any length >= 1 and
decode steps of one row. A request admitted with no prior tokens must start
from a zeroed slot: the caller zeroes ``conv_state[slot]`` on admission (HF's
zero left padding).

Work split (race-free by construction): thread (channel c, row tile) computes
the rows of its tile, except that the first K-1 rows of every request (the
only rows that read the conv state) belong to the tile holding the request's
first row, even when they spill into the next tile. That thread is the only
one that reads the request's conv state, and it writes the new state after its
own reads, so no other thread touches the slot (in the chunk-a-thread build, the
block of those threads, which stages the state in shared memory). Rows of other tiles read their
K-1 predecessors from ``x``, which this kernel never writes.

Accumulation and SiLU in float32; one rounding to storage at the end.

Three builds of that kernel, the same arithmetic in the same order (the same bits): a thread per
channel, or, where x's and out's rows are whole 16-byte aligned chunks, a thread per chunk of
channels (8 bf16 or 4 float32), which reads and writes each row's chunk as one 16-byte access
(vector.py) instead of a 2-byte access per channel; and for decode rows (a request's one row each),
a thread per row and chunk of channels whose weights and state are 16-byte accesses too, with no
search for the row's request and no shared state (``build_causal_conv1d_decode``).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from executor.kernels.primitives.codec import Codec
from executor.kernels.primitives.launch import Kernel
from executor.kernels.primitives.reduce import threads_for
from executor.kernels.primitives.vector import (VECTOR_WORDS, array_layout, build_lanes, build_vector_access,
                                                contiguous_aligned, lanes_for, vector_aligned, word_type)
from executor.numba_cuda import load_cuda
from executor.routing import CONV1D_DECODE_ROWS_PER_TILE, CONV1D_PREFILL_ROWS_PER_TILE

cuda = load_cuda()
from numba import float32  # noqa: E402  (after load_cuda's numpy fix)
from numba.np.numpy_support import from_dtype  # noqa: E402

MAX_THREADS = 128  # channels per block
#: Rows whose 16-byte chunks a thread of the vector build loads before it computes and stores any of
#: them. A row's store may alias a later row's load for all the compiler knows, so a row at a time keeps
#: one load in flight a thread, and at the 128 registers a thread the build takes (a quarter of an SM's
#: threads resident on sm_90) that leaves DRAM mostly idle; four rows a round keep four loads in flight.
ROWS_IN_FLIGHT = 4


@cuda.jit(device=True)
def request_of_row(q_indptr, num_requests, row):
    """The request b whose rows ``q_indptr[b] <= row < q_indptr[b+1]`` hold ``row`` (binary search).

    Empty requests are skipped: the largest b with ``q_indptr[b] <= row`` wins.
    """
    lo = 0
    hi = num_requests
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if q_indptr[mid] <= row:
            lo = mid
        else:
            hi = mid
    return lo


@cuda.jit(device=True, inline=True)
def row_tile(q_indptr, num_requests, rows_per_tile):
    """This block's tile [t0, t1) of the batch's rows, empty past them (rows past the batch, a graph's
    padding, are not touched)."""
    t0 = cuda.blockIdx.y * rows_per_tile
    return t0, min(t0 + rows_per_tile, q_indptr[num_requests])


@cuda.jit(device=True, inline=True)
def request_rows(q_indptr, slot_ids, b, t0, t1, hist):
    """Request b in the row tile [t0, t1): (start, end, slot, owns_start, lo, hi), its rows, its slot,
    whether the tile holds its first row, and the rows [lo, hi) the tile computes (the module
    docstring's split: the first ``hist`` rows go with the first row's tile). A padding request (slot
    -1) has no rows."""
    start = q_indptr[b]
    end = q_indptr[b + 1]
    slot = slot_ids[b]
    if slot < 0:  # a graph's padding request: no state, output unused
        end = start
    owns_start = start >= t0
    if owns_start:
        lo = start
        hi = min(end, max(t1, start + hist))  # the state-reading rows may spill past t1
    else:
        lo = max(t0, start + hist)  # those rows belong to the tile of `start`
        hi = min(end, t1)
    return start, end, slot, owns_start, lo, hi


def build_causal_conv1d(codec: Codec, kernel_size: int = 4) -> Any:
    """Kernel ``(x, weight, conv_state, q_indptr, slot_ids, out, rows_per_tile)``.

    x [T, C], weight [C, K], conv_state [slots, C, K-1], out [T, C]: storage
    dtype of ``codec``; q_indptr [B+1], slot_ids [B]: int32. Launch with grid
    (ceil(C / blockDim), ceil(T / rows_per_tile)). conv_state is updated in
    place; out must not alias x or conv_state.
    """
    if kernel_size < 2:
        raise ValueError(f"causal_conv1d: kernel_size must be >= 2, got {kernel_size}")
    load, store = codec.load, codec.store
    taps = kernel_size
    hist = kernel_size - 1  # inputs carried between calls

    @cuda.jit
    def causal_conv1d_kernel(x, weight, conv_state, q_indptr, slot_ids, out, rows_per_tile):
        c = cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x
        if c >= x.shape[1]:
            return
        num_requests = slot_ids.shape[0]
        t0, t1 = row_tile(q_indptr, num_requests, rows_per_tile)
        if t0 >= t1:
            return

        w = cuda.local.array(taps, float32)
        for i in range(taps):
            w[i] = load(weight[c, i])
        window = cuda.local.array(hist, float32)  # xfull[t - hist .. t - 1], oldest first

        b = request_of_row(q_indptr, num_requests, t0)
        while b < num_requests and q_indptr[b] < t1:
            start, end, slot, owns_start, lo, hi = request_rows(q_indptr, slot_ids, b, t0, t1, hist)
            if lo < hi:
                for i in range(hist):
                    p = lo - start + i  # position in xfull; < hist means the old state
                    if p < hist:
                        window[i] = load(conv_state[slot, c, p])
                    else:
                        window[i] = load(x[start + p - hist, c])
                for t in range(lo, hi):
                    xt = load(x[t, c])
                    acc = w[hist] * xt
                    for i in range(hist):
                        acc += w[i] * window[i]
                    out[t, c] = store(acc / (float32(1.0) + float32(math.exp(-acc))))
                    for i in range(hist - 1):
                        window[i] = window[i + 1]
                    window[hist - 1] = xt
            if owns_start and end > start:
                # New state = xfull[n .. n + hist - 1], n = rows of the request. Ascending j
                # reads state[j + n] (n >= 1) before any write reaches that index.
                n = end - start
                for j in range(hist):
                    p = n + j
                    if p < hist:
                        conv_state[slot, c, j] = conv_state[slot, c, p]
                    else:
                        conv_state[slot, c, j] = x[start + p - hist, c]
            b += 1

    return causal_conv1d_kernel


def build_causal_conv1d_vector(codec: Codec, kernel_size: int = 4) -> Any:
    """``build_causal_conv1d``'s kernel with a thread per chunk of ``lanes_for(codec)`` channels: the
    same arguments; x's and out's rows 16-byte aligned and C a whole number of chunks. Launch with grid
    (ceil(C / lanes / blockDim), ceil(T / rows_per_tile)), blockDim <= MAX_THREADS.

    A request's conv state moves through shared memory: the block's channels of one slot are one
    contiguous run of ``channels x (K-1)`` elements, which the block loads and stores a consecutive
    element a thread (whole 32-byte sectors a warp), where a thread's own ``lanes x (K-1)`` elements,
    a ``2 (K-1)``-element stride apart across the warp, would take a sector a thread for every 2-byte
    access. The state moves here for a request's first tile of a chunk and for decode rows whose
    accesses the decode build cannot take (``CausalConv1d.decode``'s fallback).
    """
    if kernel_size < 2:
        raise ValueError(f"causal_conv1d: kernel_size must be >= 2, got {kernel_size}")
    load, store = codec.load, codec.store
    taps = kernel_size
    hist = kernel_size - 1
    lanes = lanes_for(codec)
    weights_size, window_size, round_words = taps * lanes, hist * lanes, ROWS_IN_FLIGHT * VECTOR_WORDS
    stage_size = MAX_THREADS * lanes * hist  # one slot's state for the block's channels
    stage_type = from_dtype(np.dtype(codec.storage_numpy_dtype))
    load_vector, store_vector = build_vector_access()
    get_lane, put_lane = build_lanes(codec)
    words_type = word_type(codec)

    @cuda.jit
    def causal_conv1d_vector(x, weight, conv_state, q_indptr, slot_ids, out, rows_per_tile):
        # Every thread of the block runs to the end: the state copies are the block's, with barriers.
        channels = x.shape[1]
        tid = cuda.threadIdx.x
        block_c0 = cuda.blockIdx.x * cuda.blockDim.x * lanes
        block_channels = min(cuda.blockDim.x * lanes, channels - block_c0)
        c0 = block_c0 + tid * lanes
        active = c0 < channels
        num_requests = slot_ids.shape[0]
        t0, t1 = row_tile(q_indptr, num_requests, rows_per_tile)
        if t0 >= t1:  # the block's rows are past the batch: uniform across the block
            return

        stage = cuda.shared.array(stage_size, stage_type)  # [channel of the block, position], as in conv_state
        w = cuda.local.array(weights_size, float32)  # [tap, lane]: every index a constant once unrolled
        if active:
            for i in range(taps):
                for k in range(lanes):
                    w[i * lanes + k] = load(weight[c0 + k, i])
        window = cuda.local.array(window_size, float32)  # [position, lane], oldest position first
        words = cuda.local.array(round_words, words_type)  # [row of the round, word]

        b = request_of_row(q_indptr, num_requests, t0)
        while b < num_requests and q_indptr[b] < t1:  # every test below is uniform across the block
            start, end, slot, owns_start, lo, hi = request_rows(q_indptr, slot_ids, b, t0, t1, hist)
            with_state = owns_start and end > start  # the block reads and writes the slot's state
            if with_state:
                for e in range(tid, block_channels * hist, cuda.blockDim.x):
                    stage[e] = conv_state[slot, block_c0 + e // hist, e % hist]
                cuda.syncthreads()
            if active and lo < hi:
                for i in range(hist):
                    p = lo - start + i  # position in xfull; < hist means the old state
                    for k in range(lanes):
                        if p < hist:
                            window[i * lanes + k] = load(stage[(c0 - block_c0 + k) * hist + p])
                        else:
                            window[i * lanes + k] = load(x[start + p - hist, c0 + k])
                for first in range(lo, hi, ROWS_IN_FLIGHT):  # a round: its rows' loads, then each row in order
                    for r in range(ROWS_IN_FLIGHT):
                        if first + r < hi:
                            load_vector(x, (first + r, c0), words, r * VECTOR_WORDS)
                    for r in range(ROWS_IN_FLIGHT):
                        if first + r < hi:
                            for k in range(lanes):
                                xt = load(get_lane(words, r * lanes + k))
                                acc = w[hist * lanes + k] * xt
                                for i in range(hist):
                                    acc += w[i * lanes + k] * window[i * lanes + k]
                                for i in range(hist - 1):
                                    window[i * lanes + k] = window[(i + 1) * lanes + k]
                                window[(hist - 1) * lanes + k] = xt
                                put_lane(words, r * lanes + k, store(acc / (float32(1.0) + float32(math.exp(-acc)))))
                            store_vector(out, (first + r, c0), words, r * VECTOR_WORDS)
            if with_state:
                n = end - start  # the new state, as build_causal_conv1d writes it, from the staged old one
                for e in range(tid, block_channels * hist, cuda.blockDim.x):
                    c, p = e // hist, n + e % hist
                    if p < hist:
                        conv_state[slot, block_c0 + c, e % hist] = stage[c * hist + p]
                    else:
                        conv_state[slot, block_c0 + c, e % hist] = x[start + p - hist, block_c0 + c]
                cuda.syncthreads()  # the stage is read to the end before the next request's state lands
            b += 1

    return causal_conv1d_vector


def build_causal_conv1d_decode(codec: Codec, kernel_size: int = 4) -> Any:
    """The decode build: kernel ``(x, weight, conv_state, slot_ids, out)`` for rows that are each one
    request's one row (row b is request b's), a thread per (row, chunk of ``lanes_for(codec)``
    channels). x, out [B, C] with 16-byte aligned rows of whole chunks; weight as one row [1, C K] and
    conv_state as [slots, C (K-1)] (their contiguous bytes); slot_ids [B] int32 (-1: a padding row,
    skipped). Launch with grid (ceil(C / lanes / blockDim), B).

    A thread's channels' K taps and K-1 state inputs are contiguous runs of whole 16-byte chunks, so
    every access is a 16-byte vector and the only dependent load is the state after its slot: no
    request search, no shared memory, no barrier. The arithmetic is ``build_causal_conv1d``'s in its
    order (the same bits), and the new state is the old one shifted by the row's input, as stored.
    """
    if kernel_size < 2:
        raise ValueError(f"causal_conv1d: kernel_size must be >= 2, got {kernel_size}")
    load, store = codec.load, codec.store
    taps = kernel_size
    hist = kernel_size - 1
    lanes = lanes_for(codec)
    load_vector, store_vector = build_vector_access()
    get_lane, put_lane = build_lanes(codec)
    words_type = word_type(codec)
    weight_words, state_words = taps * VECTOR_WORDS, hist * VECTOR_WORDS

    @cuda.jit
    def causal_conv1d_decode(x, weight, conv_state, slot_ids, out):
        c0 = (cuda.blockIdx.x * cuda.blockDim.x + cuda.threadIdx.x) * lanes
        row = cuda.blockIdx.y
        if c0 >= x.shape[1]:
            return
        slot = slot_ids[row]
        if slot < 0:
            return
        inputs = cuda.local.array(VECTOR_WORDS, words_type)
        outputs = cuda.local.array(VECTOR_WORDS, words_type)
        w = cuda.local.array(weight_words, words_type)  # [lane, tap] as weight stores them
        old = cuda.local.array(state_words, words_type)  # [lane, position] as conv_state stores them
        new = cuda.local.array(state_words, words_type)
        load_vector(x, (row, c0), inputs, 0)
        for v in range(taps):
            load_vector(weight, (0, c0 * taps + v * lanes), w, v * VECTOR_WORDS)
        for v in range(hist):
            load_vector(conv_state, (slot, c0 * hist + v * lanes), old, v * VECTOR_WORDS)
        for k in range(lanes):
            xt = load(get_lane(inputs, k))
            acc = load(get_lane(w, k * taps + hist)) * xt
            for i in range(hist):
                acc += load(get_lane(w, k * taps + i)) * load(get_lane(old, k * hist + i))
            put_lane(outputs, k, store(acc / (float32(1.0) + float32(math.exp(-acc)))))
        store_vector(out, (row, c0), outputs, 0)
        for k in range(lanes):  # each lane's window shifted by one, the row's input last
            for i in range(hist - 1):
                put_lane(new, k * hist + i, get_lane(old, k * hist + i + 1))
            put_lane(new, k * hist + hist - 1, get_lane(inputs, k))
        for v in range(hist):
            store_vector(conv_state, (slot, c0 * hist + v * lanes), new, v * VECTOR_WORDS)

    return causal_conv1d_decode


class CausalConv1d:
    """Launcher: causal depthwise conv1d + SiLU over a batch, updating the conv state in place.

    Arrays (numpy in the simulator; torch CUDA tensors / numba device arrays on
    the GPU; strided views are fine):

    - x [T, C]: ``in_proj_qkv`` output, C = conv_dim = 2*Hk*dk + Hv*dv, storage dtype.
    - weight [C, K]: ``conv1d.weight`` squeezed from [C, 1, K], storage dtype.
    - conv_state [num_slots, C, K-1]: storage dtype, oldest input first; in place.
    - q_indptr [B+1] int32, slot_ids [B] int32: the batch (distinct slots; -1: a padding request, skipped).
    - out [T, C]: storage dtype; must not alias x or conv_state.

    Rows ``>= q_indptr[B]`` are left untouched. No scratch. x and out with 16-byte aligned rows of
    whole chunks run the chunk-a-thread build, other views the channel-a-thread one (module docstring).
    A thread takes ``rows_per_tile`` rows (the launcher's, or the call's: routing.py's
    CONV1D_PREFILL_ROWS_PER_TILE for chunks). Decode rows go through ``decode``: the decode build, or
    these at CONV1D_DECODE_ROWS_PER_TILE rows a tile where its accesses would not be aligned.
    """

    def __init__(
        self, codec: Codec, kernel_size: int = 4, rows_per_tile: int = CONV1D_PREFILL_ROWS_PER_TILE
    ) -> None:
        _check_rows_per_tile(rows_per_tile)
        self.kernel_size = kernel_size
        self.rows_per_tile = rows_per_tile
        self.lanes = lanes_for(codec)
        self.kernel = Kernel(build_causal_conv1d(codec, kernel_size))
        self.vector_kernel = Kernel(build_causal_conv1d_vector(codec, kernel_size))
        self.decode_kernel = Kernel(build_causal_conv1d_decode(codec, kernel_size))
        # (weight, conv_state, their decode-build views or None) by the pair's ids: a layer passes the same
        # two buffers at every step, so its decode launches see the same view objects (the launch memo's).
        self._state_views: dict[tuple[int, int], tuple[Any, Any, tuple[Any, Any] | None]] = {}

    def __call__(
        self,
        x: Any,
        weight: Any,
        conv_state: Any,
        q_indptr: Any,
        slot_ids: Any,
        out: Any,
        stream: Any = 0,
        rows_per_tile: int | None = None,
    ) -> None:
        rows, channels = _check_shapes(x, weight, conv_state, q_indptr, slot_ids, out, self.kernel_size)
        if rows_per_tile is None:
            rows_per_tile = self.rows_per_tile
        else:
            _check_rows_per_tile(rows_per_tile)
        if rows and channels:
            self._launch_general(x, weight, conv_state, q_indptr, slot_ids, out, stream, rows_per_tile)

    def _launch_general(self, x: Any, weight: Any, conv_state: Any, q_indptr: Any, slot_ids: Any, out: Any,
                        stream: Any, rows_per_tile: int) -> None:
        """The chunk-a-thread build where x's and out's rows allow it, else the channel-a-thread one (shapes
        checked, at least one row and channel)."""
        rows, channels = int(x.shape[0]), int(x.shape[1])
        kernel, units = self.kernel, channels
        if self.uses_vector(x, out):
            kernel, units = self.vector_kernel, channels // self.lanes
        threads = threads_for(units, MAX_THREADS)
        grid = ((units + threads - 1) // threads, (rows + rows_per_tile - 1) // rows_per_tile)
        kernel[grid, threads, stream](x, weight, conv_state, q_indptr, slot_ids, out, rows_per_tile)

    def decode(
        self,
        x: Any,
        weight: Any,
        conv_state: Any,
        q_indptr: Any,
        slot_ids: Any,
        out: Any,
        stream: Any = 0,
    ) -> None:
        """``__call__`` for rows that are each one request's one row (row b is request b's: q_indptr 0, 1,
        .., B), a decode step's or a prefill step's leading decode rows: the decode build where x, out,
        weight and conv_state are whole aligned 16-byte chunks (``decode_views``), else ``__call__`` at
        CONV1D_DECODE_ROWS_PER_TILE rows a tile."""
        rows, channels = _check_shapes(x, weight, conv_state, q_indptr, slot_ids, out, self.kernel_size)
        if rows != int(slot_ids.shape[0]):
            raise ValueError(f"causal_conv1d decode: {rows} rows for {int(slot_ids.shape[0])} requests; decode "
                             f"rows are one a request")
        if rows == 0 or channels == 0:
            return
        views = self.decode_views(x, weight, conv_state, out)
        if views is None:
            self._launch_general(x, weight, conv_state, q_indptr, slot_ids, out, stream, CONV1D_DECODE_ROWS_PER_TILE)
            return
        weight_row, state_rows = views
        units = channels // self.lanes
        threads = threads_for(units, MAX_THREADS)
        self.decode_kernel[((units + threads - 1) // threads, rows), threads, stream](
            x, weight_row, state_rows, slot_ids, out)

    def decode_views(self, x: Any, weight: Any, conv_state: Any, out: Any) -> tuple[Any, Any] | None:
        """(weight as one row [1, C K], conv_state as [slots, C (K-1)]): the same bytes, as the decode
        build reads them; None unless a channel's taps and state are contiguous and every 16-byte chunk
        of x, out and those views is aligned. The views are made once per (weight, conv_state) pair."""
        if int(x.shape[1]) % self.lanes or not vector_aligned(x, out):
            return None
        key = (id(weight), id(conv_state))
        entry = self._state_views.get(key)
        if entry is None or entry[0] is not weight or entry[1] is not conv_state:
            entry = self._state_views[key] = (weight, conv_state, self._merged_views(weight, conv_state))
        return entry[2]

    def _merged_views(self, weight: Any, conv_state: Any) -> tuple[Any, Any] | None:
        """``decode_views``' two views of weight and conv_state, or None where they cannot be made aligned."""
        taps, hist = self.kernel_size, self.kernel_size - 1
        if not contiguous_aligned(weight):
            return None
        slots, channels = int(conv_state.shape[0]), int(conv_state.shape[1])
        layout = array_layout(conv_state)
        if layout.strides_bytes[1:] != (hist * layout.itemsize_bytes, layout.itemsize_bytes):
            return None
        weight_row = _merged(weight, (1, channels * taps))
        state_rows = _merged(conv_state, (slots, channels * hist))
        return (weight_row, state_rows) if vector_aligned(weight_row, state_rows) else None

    def uses_vector(self, x: Any, out: Any) -> bool:
        """Whether a call with these rows runs the chunk-a-thread build."""
        return int(x.shape[1]) % self.lanes == 0 and vector_aligned(x, out)


def _merged(a: Any, shape: tuple[int, int]) -> Any:
    """A view of ``a`` (its trailing axes contiguous) with those axes merged into ``shape``'s second:
    never a copy, which would leave the kernel's writes out of ``a``."""
    if hasattr(a, "data_ptr"):
        return a.view(shape)
    return np.lib.stride_tricks.as_strided(a, shape=shape, strides=(a.strides[0], a.dtype.itemsize))


def _check_rows_per_tile(rows_per_tile: int) -> None:
    if rows_per_tile < 1:
        raise ValueError(f"causal_conv1d: rows_per_tile must be >= 1, got {rows_per_tile}")


def _check_shapes(
    x: Any, weight: Any, conv_state: Any, q_indptr: Any, slot_ids: Any, out: Any, kernel_size: int
) -> tuple[int, int]:
    """Validate the launcher's shapes; return (T, C)."""
    if len(x.shape) != 2:
        raise ValueError(f"causal_conv1d: x must be [T, C], got {tuple(x.shape)}")
    rows, channels = int(x.shape[0]), int(x.shape[1])
    if tuple(out.shape) != (rows, channels):
        raise ValueError(f"causal_conv1d: out must be [{rows}, {channels}], got {tuple(out.shape)}")
    if tuple(weight.shape) != (channels, kernel_size):
        raise ValueError(f"causal_conv1d: weight must be [{channels}, {kernel_size}], got {tuple(weight.shape)}")
    if len(conv_state.shape) != 3 or tuple(conv_state.shape[1:]) != (channels, kernel_size - 1):
        raise ValueError(
            f"causal_conv1d: conv_state must be [slots, {channels}, {kernel_size - 1}], got {tuple(conv_state.shape)}"
        )
    if len(slot_ids.shape) != 1 or tuple(q_indptr.shape) != (int(slot_ids.shape[0]) + 1,):
        raise ValueError(
            f"causal_conv1d: need q_indptr [B+1] and slot_ids [B], got {tuple(q_indptr.shape)}, {tuple(slot_ids.shape)}"
        )
    return rows, channels
