"""Where a prefill step's decode rows launch: on the step's stream, or on a second stream beside its chunks.

A prefill step that carries decode rows runs two independent sets of kernels in each mixer's ``attend``:
the decode rows' (decode attention over their KV pages; conv1d and the decode delta rule over their
recurrent state), which are HBM-bound, and the chunks' (FlashAttention or paged attention; the chunked
delta rule), which are tensor-core or latency-bound. They read the same step metadata and write disjoint
rows, pages and recurrent slots, so nothing orders them but the stream they share. ``SideStream``
launches the decode rows on a second CUDA stream: ``fork`` orders it after everything the step's stream
has queued (the projections and the KV write) and ``join`` makes the step's stream wait for it before
the rows' outputs are read (the mixer's ``finish``). Which of the two serves is routing.py's
``DECODE_ROWS_SIDE_STREAM``.

Decode steps never fork: all their rows are decode rows, and their CUDA graphs record one stream.
"""

from __future__ import annotations

from typing import Any, Protocol

import torch

from executor.device import Device


class DecodeRowsStream(Protocol):
    """``fork(step_stream)`` returns the stream to launch the decode rows on; ``join()`` orders the step's
    stream after them."""

    def fork(self, step_stream: Any) -> Any: ...
    def join(self) -> None: ...


class StepStream:
    """The decode rows on the step's own stream, in launch order (the simulator's and the meta device's,
    which have one stream)."""

    def fork(self, step_stream: Any) -> Any:
        return step_stream

    def join(self) -> None:
        pass


class SideStream:
    """The decode rows on a second CUDA stream of ``device``, made once with its two events (``fork`` and
    ``join`` allocate nothing). ``high_priority``: the block scheduler dispatches its blocks first when
    both streams have blocks waiting, so the HBM-bound decode rows start while the chunks' kernels fill
    the rest of the GPU."""

    def __init__(self, device: Device, high_priority: bool = True):
        if device.kind != "cuda":
            raise ValueError(f"a side stream needs a CUDA device, not {device.kind!r}")
        self.torch_device = device.torch_device
        # A lower number is a higher priority; torch maps -1 to the device's highest if it allows fewer.
        self.torch_stream = torch.cuda.Stream(self.torch_device, priority=-1 if high_priority else 0)
        self.stream = device.numba_stream(self.torch_stream)
        self.high_priority = high_priority
        self._forked = torch.cuda.Event()
        self._joined = torch.cuda.Event()
        self._step_stream: torch.cuda.Stream | None = None

    def fork(self, step_stream: Any) -> Any:
        self._step_stream = torch.cuda.current_stream(self.torch_device)
        self._forked.record(self._step_stream)
        self.torch_stream.wait_event(self._forked)
        return self.stream

    def join(self) -> None:
        assert self._step_stream is not None, "join without fork"
        self._joined.record(self.torch_stream)
        self._step_stream.wait_event(self._joined)
        self._step_stream = None


def decode_rows_stream(device: Device, side: bool) -> DecodeRowsStream:
    """A ``SideStream`` where ``side`` and the device has streams (CUDA), else the ``StepStream``."""
    return SideStream(device) if side and device.kind == "cuda" else StepStream()
