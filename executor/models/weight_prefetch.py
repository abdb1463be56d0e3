"""``WeightPrefetch``: a block's last projection weight into L2 while its latency-bound middle runs.

In a GEMV decode step (projections.py's ``GemvProjections``) a block's first projection keeps HBM
busy, and then its middle does not: q/k norm + RoPE, paged attention and the merge (or Qwen3.5's
conv, gates, delta rule and gated norm) move a few megabytes in ~20 us. ``start`` forks a side
stream off the current one right after the first projection and prefetches the last projection's
weight into L2 there (kernels/l2_prefetch.py); ``join`` makes the current stream wait for it just
before that projection, which then reads L2. The side stream only reads weights, so the join is
for stream capture (a CUDA graph must rejoin every stream it forked), not for correctness; both
eager steps and the decode graphs (which record the fork and the join as graph edges) run it.

In the simulator there is no cache and no second stream: ``start`` launches on the current stream.
"""

from __future__ import annotations

from typing import Any

import torch

from executor.device import Device
from executor.kernels.l2_prefetch import L2Prefetch


class WeightPrefetch:
    """Fork, prefetch, join: one side stream and one pair of events, reused by every block."""

    def __init__(self, device: Device, prefetch: L2Prefetch):
        self.device, self.prefetch = device, prefetch
        self.pending = False  # a started prefetch the current stream has not joined yet
        if device.is_sim:
            self.side = self.side_launch = None
            return
        self.side = torch.cuda.Stream(device.torch_device)
        self.side_launch = device.numba_stream(self.side)
        self.forked, self.done = torch.cuda.Event(), torch.cuda.Event()

    def start(self, weight_bytes: torch.Tensor, stream: Any) -> None:
        """Prefetch ``weight_bytes`` (a uint8 [n] view that ``L2Prefetch.check`` accepted) on the side
        stream, after the work queued so far on the current stream (``stream`` is its Numba handle)."""
        assert not self.pending, "a block joins its prefetch before starting another"
        if self.side is None:
            self.prefetch(weight_bytes, stream=stream)
            return
        current = torch.cuda.current_stream(self.device.torch_device)
        self.forked.record(current)
        self.side.wait_event(self.forked)
        self.prefetch(weight_bytes, stream=self.side_launch)
        self.done.record(self.side)
        self.pending = True

    def join(self) -> None:
        """Make the current stream wait for the started prefetch, if any."""
        if self.pending:
            torch.cuda.current_stream(self.device.torch_device).wait_event(self.done)
            self.pending = False
