"""Where the host stalls: sample one thread's Python stack at a fixed interval and report the longest runs of
samples whose innermost frames did not change.

A launch that the host spends hundreds of milliseconds in once (a first-time cost, a blocking call) hides in
cProfile's totals; a sampler sees it as one long run of identical stacks. Used by ``bench/serve.py
--sample-stacks``; the sampling thread takes the GIL for a moment every interval, so the sampled run is a
diagnostic, not a timing.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from types import FrameType

#: Seconds between two samples.
INTERVAL_S = 0.002
#: Innermost frames that must match for two samples to belong to one run.
RUN_FRAMES = 3
#: Frames of a run's stack the report prints, innermost first.
REPORT_FRAMES = 24


def frame_stack(frame: FrameType | None, depth: int = 64) -> tuple[str, ...]:
    """``file:line function`` of ``frame`` and its callers, innermost first, at most ``depth`` of them."""
    stack = []
    while frame is not None and len(stack) < depth:
        code = frame.f_code
        stack.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
        frame = frame.f_back
    return tuple(stack)


@dataclass(frozen=True)
class StackRun:
    """Consecutive samples with the same innermost frames: when the first was taken (seconds after the
    sampler started), how long the run lasted, how many samples, and the first sample's stack."""

    start_s: float
    seconds: float
    samples: int
    stack: tuple[str, ...]


@dataclass
class StackSampler:
    """A context manager that samples the entering thread's stack from a background thread."""

    interval_s: float = INTERVAL_S
    samples: list[tuple[float, tuple[str, ...]]] = field(default_factory=list)

    def __enter__(self) -> StackSampler:
        self._target = threading.get_ident()
        self._stop = threading.Event()
        self._start = time.perf_counter()
        self._thread = threading.Thread(target=self._sample, name="stack-sampler", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def _sample(self) -> None:
        while not self._stop.wait(self.interval_s):
            frame = sys._current_frames().get(self._target)
            self.samples.append((time.perf_counter() - self._start, frame_stack(frame)))

    def runs(self) -> list[StackRun]:
        """Every run of samples sharing their RUN_FRAMES innermost frames, longest first."""
        runs, first = [], 0
        for index in range(1, len(self.samples) + 1):
            if index == len(self.samples) or self.samples[index][1][:RUN_FRAMES] != self.samples[first][1][:RUN_FRAMES]:
                start_s, stack = self.samples[first]
                runs.append(StackRun(start_s, self.samples[index - 1][0] - start_s, index - first, stack))
                first = index
        return sorted(runs, key=lambda run: run.seconds, reverse=True)

    def report(self, min_ms: float, most: int = 10) -> str:
        """The ``most`` longest runs of at least ``min_ms`` ms, each with its stack (markdown)."""
        runs = [run for run in self.runs() if run.seconds * 1e3 >= min_ms][:most]
        if not runs:
            return f"no run of one stack lasted {min_ms:g} ms or more ({len(self.samples):,} samples)"
        parts = [f"{len(self.samples):,} samples every {self.interval_s * 1e3:g} ms; the runs of one stack of "
                 f"{min_ms:g} ms or more, longest first:"]
        for run in runs:
            frames = "\n".join(f"    {line}" for line in run.stack[:REPORT_FRAMES])
            parts.append(f"- {run.seconds * 1e3:,.1f} ms ({run.samples} samples) from {run.start_s:.3f} s:\n\n"
                         f"  ```\n{frames}\n  ```")
        return "\n\n".join(parts)
