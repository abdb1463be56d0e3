"""Buffers, pools, and how buffers are placed in a pool.

A ``BufferRequest`` is what a buffer-group builder asks for: a name, a dtype, a
shape and, for transient buffers, a live range over the stages of a step. The
element count and the bytes of a buffer are computed here and only here
(invariant 1, docs/design.md: one layout, two uses); the executor allocates
from the placed ``Buffer`` and the budget sums the same ``Pool.bytes``.

Persistent pools place buffers one after another. Transient pools place each
buffer at the lowest offset where it does not overlap, in bytes, any placed
buffer whose live range overlaps its own; the pool's size is the peak of that
packing (invariant 6, docs/design.md).
"""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ConfigDict, Field

from planner import checked
from planner.dtypes import dtype_bytes

#: Every buffer (and every fused view's first part) starts on this boundary, bytes.
ALIGNMENT_BYTES = 256


class Buffer(BaseModel):
    """One planned buffer: a typed, shaped view at ``offset`` bytes into its pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int = Field(ge=0, description="bytes from the pool's start")
    bytes: int = Field(ge=0, description="element count x dtype size")
    live: tuple[int, int] | None = Field(
        None, description="first and last stage index the buffer is live in (transient pools)"
    )


class FusedView(BaseModel):
    """Adjacent buffers read as one matrix (e.g. q|k|v projection weights for one GEMM)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    parts: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    offset: int = Field(ge=0)
    bytes: int = Field(ge=0)


class Pool(BaseModel):
    """A group of buffers the executor allocates as one device allocation of ``bytes``."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bytes: int = Field(ge=0, description="allocation size: end of the last byte any buffer uses, aligned")
    materialized: bool = Field(True, description="false for budget-only lines the executor does not allocate")
    buffers: tuple[Buffer, ...] = ()
    fused: tuple[FusedView, ...] = ()

    def buffer(self, name: str) -> Buffer:
        for buffer in self.buffers:
            if buffer.name == name:
                return buffer
        raise KeyError(f"pool {self.name!r} has no buffer {name!r}")


@dataclass(frozen=True)
class BufferRequest:
    """A buffer a group builder needs. ``group``: fused with its neighbours of the same group."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    live: tuple[int, int] | None = None
    group: str | None = None


def buffer_bytes(request: BufferRequest) -> int:
    """Bytes of a request: product of the shape times the element size, checked as u64.

    Each dimension must also fit i32, because kernels index with i32.
    """
    for axis, extent in enumerate(request.shape):
        checked.fit(f"{request.name} shape[{axis}]", extent, checked.I32)
        if extent < 0:
            raise ValueError(f"{request.name}: negative extent {extent} in shape {request.shape}")
    elements = checked.mul(f"{request.name} elements", *request.shape, width=checked.U64)
    return checked.mul(f"{request.name} bytes", elements, dtype_bytes(request.dtype), width=checked.U64)


def pack_sequential(name: str, requests: list[BufferRequest], fused_shapes: dict[str, tuple[int, ...]] | None = None) -> Pool:
    """A persistent pool: buffers back to back, each aligned, fused groups packed tight.

    ``fused_shapes`` gives the matrix shape of each fused group, keyed by group name.
    """
    buffers: list[Buffer] = []
    groups: dict[str, list[Buffer]] = {}
    cursor = 0
    previous_group: str | None = None
    for request in requests:
        size = buffer_bytes(request)
        joins_group = request.group is not None and request.group == previous_group
        if not joins_group:
            cursor = checked.align_up(f"{name} offset", cursor, ALIGNMENT_BYTES)
        buffer = Buffer(name=request.name, dtype=request.dtype, shape=request.shape, offset=cursor, bytes=size)
        buffers.append(buffer)
        if request.group is not None:
            groups.setdefault(request.group, []).append(buffer)
        cursor = checked.add(f"{name} bytes", cursor, size)
        previous_group = request.group
    fused = tuple(_fused_view(group, parts, (fused_shapes or {})[group]) for group, parts in groups.items())
    return Pool(name=name, bytes=checked.align_up(f"{name} bytes", cursor, ALIGNMENT_BYTES),
                buffers=tuple(buffers), fused=fused)


def pack_by_lifetime(name: str, requests: list[BufferRequest]) -> Pool:
    """A transient pool: buffers whose live ranges do not overlap share bytes.

    Greedy: largest first, each at the lowest aligned offset free of every placed
    buffer that is live at the same time. Pool bytes = the highest end offset.
    """
    order = sorted(range(len(requests)), key=lambda i: (-buffer_bytes(requests[i]), i))
    placed: dict[int, Buffer] = {}
    for index in order:
        request = requests[index]
        if request.live is None:
            raise ValueError(f"{name}/{request.name}: a transient buffer needs a live range")
        size = buffer_bytes(request)
        busy = sorted(
            (b.offset, b.offset + b.bytes) for b in placed.values() if _overlaps(b.live, request.live)
        )
        offset = 0
        for start, end in busy:
            if offset + size <= start:
                break
            offset = max(offset, checked.align_up(f"{name} offset", end, ALIGNMENT_BYTES))
        placed[index] = Buffer(
            name=request.name, dtype=request.dtype, shape=request.shape, offset=offset, bytes=size, live=request.live
        )
    buffers = tuple(placed[i] for i in range(len(requests)))
    peak = max((b.offset + b.bytes for b in buffers), default=0)
    return Pool(name=name, bytes=checked.align_up(f"{name} bytes", peak, ALIGNMENT_BYTES), buffers=buffers)


def budget_pool(name: str, lines: list[tuple[str, int]]) -> Pool:
    """A pool of budget lines the executor does not allocate (runtime costs outside the arena)."""
    buffers, cursor = [], 0
    for line, size in lines:  # bytes, not kernel-indexed elements: no i32 bound per line
        buffers.append(Buffer(name=line, dtype="uint8", shape=(size,), offset=cursor, bytes=size))
        cursor = checked.add(f"{name} bytes", cursor, size)
    return Pool(name=name, bytes=cursor, materialized=False, buffers=tuple(buffers))


def _overlaps(a: tuple[int, int] | None, b: tuple[int, int] | None) -> bool:
    assert a is not None and b is not None
    return a[0] <= b[1] and b[0] <= a[1]


def _fused_view(group: str, parts: list[Buffer], shape: tuple[int, ...]) -> FusedView:
    first, last = parts[0], parts[-1]
    total = checked.sub(f"{group} bytes", last.offset + last.bytes, first.offset)
    assert all(p.dtype == first.dtype for p in parts), f"{group}: parts differ in dtype"
    expected = buffer_bytes(BufferRequest(group, first.dtype, shape))
    assert total == expected, f"{group}: parts span {total} bytes, shape {shape} needs {expected}"
    return FusedView(name=group, parts=tuple(p.name for p in parts), dtype=first.dtype, shape=shape,
                     offset=first.offset, bytes=total)
