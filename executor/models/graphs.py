"""Decode and prefill steps as CUDA graphs, captured once after materialize.

Decode (``DecodeGraphs``): one graph of the whole forward per batch bucket.

A Numba launch costs tens of microseconds of host time, more than the
weight-streaming floor of a small decode step, so decode replays graphs (a few
microseconds each). A graph bakes in every shape and address; the arena's
addresses never move (invariant 5, docs/design.md), and the shapes are the
bucket's: a step of ``b`` requests is padded to the smallest bucket ``>= b``
(``step.pad_decode``) and its metadata copied into the same planned buffers the
graph reads. The serving config lists the buckets and the plan budgets their
pools as the ``cuda_graphs`` runtime line.

Prefill and mixed steps (``PrefillGraphs``): piecewise. Their attention launches follow the step's
requests (tiles, long chunks, the delta rule's route), so those run eagerly; everything between two
of them (the decoder's ``num_layers + 1`` pieces: o_proj or out_proj, the norms, the MLP, the next
layer's input projection with its q/k norm + RoPE or its gates) works on rows alone and replays, per row bucket, as one graph each. A
step of ``n`` rows replays the pieces of the smallest bucket ``>= n``: the pieces compute the
padded rows too, which nothing reads (row-wise kernels never mix rows, and the eager launches and
the lm_head read only the step's rows). The plan lists the buckets (capacity.prefill_graph_rows)
and budgets the pieces as the ``prefill_graphs`` runtime line.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable, Sequence

import torch

from executor.arena import Arena
from executor.models.context import StepViews, bucket_views, prefill_bucket_views
from executor.step import StepMetadata, decode_grid_tiles, pad_decode, plan_step
from executor.step_writer import StepWriter

Forward = Callable[[StepViews], None]
#: Piece ``index`` (0 .. num_layers) of the decoder's GEMM forward over a step's views.
Piece = Callable[[int, StepViews], None]


def smallest_bucket(buckets: Sequence[int], size: int) -> int | None:
    """The smallest of the sorted ``buckets`` that is at least ``size``, or None."""
    index = bisect.bisect_left(buckets, size)
    return buckets[index] if index < len(buckets) else None


class DecodeGraphs:
    """The captured decode graphs of one model, by bucket (CUDA only)."""

    def __init__(self, arena: Arena, writer: StepWriter, forward: Forward, buckets: Sequence[int]):
        assert not arena.device.is_sim, "the simulator has no CUDA graphs"
        self.arena, self.writer, self.forward = arena, writer, forward
        self.buckets = tuple(sorted(buckets))
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}

    def bucket_for(self, num_requests: int) -> int | None:
        """The smallest captured bucket that holds ``num_requests`` decode rows, or None."""
        return smallest_bucket(self.buckets, num_requests)

    def capture(self) -> None:
        """Capture every bucket, largest first, into one shared memory pool.

        Each bucket first runs once eagerly on the capture stream with an all-padding step (its
        kernels' first launches, which load them from the kernel cache or compile them; cuBLAS
        picks and sets up its GEMMs), then is recorded. Kernels launch on torch's current stream
        (``device.current_stream()``), which inside ``torch.cuda.graph`` is the capture stream.

        The buckets launch specializations that warm-up does not: the fused decode attention with
        strided q/k/v views (one row is contiguous, two or more are not), its tensor-core shape for
        many (row, kv head) pairs, the GEMV kernels of each batch up to decode_gemv_max_batch.
        Compiled here, they were most of capture's cost; kernel discovery runs these same eager
        passes (executor/kernel_discovery.py), so the start-up compile puts them in the cache first.
        """
        plan, device = self.arena.plan, self.arena.device
        empty = plan_step(plan, [])  # padded to a bucket: all padding
        pool = torch.cuda.graph_pool_handle()
        capture_stream = torch.cuda.Stream(device.torch_device)
        for bucket in reversed(self.buckets):
            self.writer.write(pad_decode(plan, empty, bucket))
            # The writer copies asynchronously on the current stream: without this wait the warm-up
            # forward could read the previous step's metadata and run a real request's step (on
            # Qwen3.5, advancing its recurrent state).
            capture_stream.wait_stream(torch.cuda.current_stream(device.torch_device))
            with torch.cuda.stream(capture_stream):
                views = bucket_views(self.arena, bucket, decode_grid_tiles(plan, bucket))  # on the capture stream
                self.forward(views)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                self.forward(views)
            self.graphs[bucket] = graph
        torch.cuda.current_stream(device.torch_device).wait_stream(capture_stream)
        torch.cuda.synchronize(device.torch_device)

    def replay(self, meta: StepMetadata, bucket: int) -> None:
        """Pad ``meta`` to ``bucket``, copy it into the planned buffers and replay that bucket's graph."""
        self.writer.write(pad_decode(self.arena.plan, meta, bucket))
        self.graphs[bucket].replay()


class PrefillGraphs:
    """The captured pieces of prefill steps, by row bucket (CUDA only)."""

    def __init__(self, arena: Arena, piece: Piece, num_pieces: int, buckets: Sequence[int]):
        assert not arena.device.is_sim, "the simulator has no CUDA graphs"
        self.arena, self.piece, self.num_pieces = arena, piece, num_pieces
        self.buckets = tuple(sorted(buckets))
        self.graphs: dict[int, tuple[torch.cuda.CUDAGraph, ...]] = {}

    def bucket_for(self, num_rows: int) -> int | None:
        """The smallest captured bucket of at least ``num_rows`` rows, or None."""
        return smallest_bucket(self.buckets, num_rows)

    def capture(self) -> None:
        """Capture every bucket's pieces, largest bucket first, into one shared memory pool.

        Each piece first runs once eagerly on the capture stream (cuBLAS picks and sets up its GEMMs
        at the bucket's rows), then is recorded. The pieces read and write only the prefill pool's row
        buffers and the weights, so running them over whatever those rows hold at start-up touches no
        request's state (KV pages, recurrent state, sampling buffers).
        """
        device = self.arena.device
        pool = torch.cuda.graph_pool_handle()
        capture_stream = torch.cuda.Stream(device.torch_device)
        capture_stream.wait_stream(torch.cuda.current_stream(device.torch_device))
        for bucket in reversed(self.buckets):
            with torch.cuda.stream(capture_stream):
                views = prefill_bucket_views(self.arena, bucket)  # on the capture stream
                for index in range(self.num_pieces):
                    self.piece(index, views)
            pieces = []
            for index in range(self.num_pieces):
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=capture_stream):
                    self.piece(index, views)
                pieces.append(graph)
            self.graphs[bucket] = tuple(pieces)
        torch.cuda.current_stream(device.torch_device).wait_stream(capture_stream)
        torch.cuda.synchronize(device.torch_device)

    def replay(self, bucket: int, index: int) -> None:
        """Replay piece ``index`` of ``bucket`` on the current stream."""
        self.graphs[bucket][index].replay()
