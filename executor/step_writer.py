"""``StepWriter``: a step's host metadata into the planned buffers, in place, in few copies.

``plan_step`` (step.py) builds a step's host arrays; the writer copies them into the leading
elements of the planned metadata buffers (attention plan, sampling parameters, token ids, slot
ids) through pinned host mirrors, merging nearby buffers into one asynchronous copy. Nothing is
allocated on the device.

The copies go straight to the driver (``cuMemcpyHtoDAsync`` on torch's current stream): a torch
``copy_`` of a pinned slice costs ~14 us of host time in dispatch, views and the pinned
allocator's bookkeeping (five of them make a batch-1 Qwen3-8B write take 68.6 us on the H200,
against 40.3 us through the driver; docs/benchmarks.md, "Host work of a decode step").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from executor.arena import Arena
from executor.step import StepMetadata
from planner.layout import Buffer, Pool


#: metadata field -> (pool, buffer) it is copied into.
_DESTINATIONS = {
    "page_indices": ("attention_plan", "page_indices"),
    "page_indptr": ("attention_plan", "page_indptr"),
    "last_page_len": ("attention_plan", "last_page_len"),
    "batch_indices": ("attention_plan", "batch_indices"),
    "positions": ("attention_plan", "positions"),
    "q_indptr": ("attention_plan", "q_indptr"),
    "request_indices": ("attention_plan", "request_indices"),
    "qo_tile_indices": ("attention_plan", "qo_tile_indices"),
    "kv_tile_indices": ("attention_plan", "kv_tile_indices"),
    "kv_chunk_size": ("attention_plan", "kv_chunk_size"),
    "logits_indices": ("sampling", "logits_indices"),
    "temperature": ("sampling", "temperature"),
    "top_k": ("sampling", "top_k"),
    "top_p": ("sampling", "top_p"),
    "seeds": ("sampling", "seeds"),
    "sample_steps": ("sampling", "sample_steps"),
}


#: Two written ranges of one pinned mirror at most this far apart go over in one copy: each copy is a
#: driver call and a DMA launch of its own, while 64 KiB more over PCIe is a few microseconds on the stream.
MERGE_GAP_BYTES = 64 << 10


@dataclass(frozen=True)
class _Segment:
    """Nearby metadata buffers of one pool: one host mirror of their byte span, copied in merged ranges.

    No other buffer of the pool overlaps the span, so copying a gap between two written ranges
    (the unused tail of a buffer) writes back bytes the mirror already holds on the device.
    """

    device: torch.Tensor  # uint8 [span] view of the pool
    mirror: torch.Tensor  # uint8 [span] host (pinned on CUDA); equals ``device`` after every write
    device_address: int  # device.data_ptr(), kept: the copies address bytes, not tensors
    mirror_address: int  # mirror.data_ptr()


@dataclass(frozen=True)
class _Target:
    """Where a metadata field lands: a typed host view into its segment's mirror."""

    segment: int
    start_bytes: int  # offset of the buffer in the segment
    host: np.ndarray  # [capacity] the buffer's dtype, a view of the mirror


class StepWriter:
    """Copies a step's host arrays into the leading elements of the planned buffers (in place).

    Each array is written into a host mirror of its buffer (a numpy view, no torch call), then every
    run of nearby buffers goes over in as few asynchronous copies as their gaps allow
    (``MERGE_GAP_BYTES``), on torch's current stream, where the kernels run (a torch copy per
    buffer, ~18 of them, costs 0.65 ms of host time per batch-1 Qwen3-8B decode step on an H200, a
    tenth of the step). The mirrors are host memory (pinned on CUDA), made once here. An event
    recorded after a step's copies keeps the next ``write`` from refilling a mirror before the GPU
    has read it; a consumer on another stream must wait for the current one. In the simulator the
    copies are plain host copies.
    """

    def __init__(self, arena: Arena):
        plan = arena.plan
        destinations = dict(_DESTINATIONS)
        destinations["total_num_rows"] = ("attention_plan", "total_num_rows")
        destinations.update({f"{pool}.token_ids": (pool, "token_ids") for pool in ("decode", "prefill")})
        if plan.geometry.num_linear_layers:
            destinations["slot_ids"] = ("recurrent_state", "slot_ids")
        pinned = arena.device.kind == "cuda"  # the simulator and the meta device (no data) copy on the host
        self.segments: list[_Segment] = []
        self.targets: dict[str, _Target] = {}
        for pool_name in sorted({pool for pool, _ in destinations.values()}):
            fields = {name: field for field, (pool, name) in destinations.items() if pool == pool_name}
            pool = plan.pool(pool_name)
            for run in _segment_runs(pool, set(fields)):
                base, end = run[0].offset, max(buffer.offset + buffer.bytes for buffer in run)
                device = arena.pools[pool_name][base:end]
                mirror = torch.empty(end - base, dtype=torch.uint8, pin_memory=pinned)
                if not device.is_meta:
                    mirror.copy_(device)  # so that copying a gap writes back what the device holds
                mirror_bytes = mirror.numpy()
                for buffer in run:
                    start = buffer.offset - base
                    host = mirror_bytes[start : start + buffer.bytes].view(np.dtype(buffer.dtype))
                    self.targets[fields[buffer.name]] = _Target(len(self.segments), start, host)
                self.segments.append(_Segment(device, mirror, device.data_ptr(), mirror.data_ptr()))
        self.copied = torch.cuda.Event() if pinned else None
        self.torch_device = arena.device.torch_device
        self.copy_async = _driver_copy() if pinned else None

    def write(self, meta: StepMetadata) -> None:
        """Copy ``meta`` in (asynchronously on CUDA: the arrays are read from the mirrors, not ``meta``)."""
        if self.copied is not None:
            self.copied.synchronize()  # the previous step's copies have read the mirrors
        arrays = {field: getattr(meta, field) for field in _DESTINATIONS}
        arrays["total_num_rows"] = np.array([meta.num_rows], dtype=np.uint32)
        arrays[f"{meta.pool}.token_ids"] = meta.token_ids
        if "slot_ids" in self.targets:
            arrays["slot_ids"] = meta.slot_ids
        written: list[list[tuple[int, int]]] = [[] for _ in self.segments]
        for field, values in arrays.items():
            count = values.shape[0]
            if count:
                target = self.targets[field]
                assert count <= target.host.shape[0], "plan_step checked every capacity"
                target.host[:count] = values
                written[target.segment].append((target.start_bytes, target.start_bytes + values.itemsize * count))
        if self.copy_async is None:  # the simulator (and the meta device): plain host copies
            for segment, ranges in zip(self.segments, written):
                for start, end in _merged(ranges):
                    segment.device[start:end].copy_(segment.mirror[start:end])
            return
        stream = torch.cuda.current_stream(self.torch_device).cuda_stream
        for segment, ranges in zip(self.segments, written):
            for start, end in _merged(ranges):
                self.copy_async(segment.device_address + start, segment.mirror_address + start, end - start, stream)
        self.copied.record()


def _driver_copy() -> Callable[[int, int, int, int], None]:
    """``copy(device_address, host_address, num_bytes, stream_handle)``: an asynchronous host-to-device
    copy through the driver (the host memory must be pinned); raises RuntimeError on a driver error."""
    from cuda.bindings import driver

    success = driver.CUresult.CUDA_SUCCESS

    def copy(device_address: int, host_address: int, num_bytes: int, stream: int) -> None:
        (error,) = driver.cuMemcpyHtoDAsync(device_address, host_address, num_bytes, stream)
        if error != success:
            raise RuntimeError(f"cuMemcpyHtoDAsync of {num_bytes} bytes to {device_address:#x} failed: {error}")

    return copy


def _segment_runs(pool: Pool, names: set[str]) -> list[list[Buffer]]:
    """The buffers ``names`` of ``pool`` in runs by offset: a run's buffers are at most MERGE_GAP_BYTES
    apart and no other buffer or fused view of the pool overlaps the run's byte span."""
    wanted = sorted((b for b in pool.buffers if b.name in names), key=lambda b: b.offset)
    others = [(b.offset, b.offset + b.bytes) for b in (*pool.buffers, *pool.fused) if b.name not in names]
    runs: list[list[Buffer]] = []
    for buffer in wanted:
        if runs:
            run = runs[-1]
            base, end = run[0].offset, max(b.offset + b.bytes for b in run)
            span_end = max(end, buffer.offset + buffer.bytes)
            if buffer.offset - end <= MERGE_GAP_BYTES and not any(lo < span_end and base < hi for lo, hi in others):
                run.append(buffer)
                continue
        runs.append([buffer])
    return runs


def _merged(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges sorted and joined where at most MERGE_GAP_BYTES apart."""
    merged: list[tuple[int, int]] = []
    for start, end in sorted(ranges):
        if merged and start - merged[-1][1] <= MERGE_GAP_BYTES:
            merged[-1] = (merged[-1][0], max(merged[-1][1], end))
        else:
            merged.append((start, end))
    return merged
