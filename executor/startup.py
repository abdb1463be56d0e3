"""Start-up phases of ``memplan run``: how long each step from process start to the first token took.

``StartupClock`` marks the end of each phase (``memplan run``'s: plan, imports, requests, kernel
cache, materialize, weights, kernels, warm-up, graph capture) on one monotonic clock; the first
phase, ``interpreter``, is the time from the process's start (the kernel's start time of this
process, on Linux) to the clock's creation: interpreter start-up and the command line's imports. ``KernelCensus`` counts, over a model's kernels, the
specializations loaded from the persistent cache and those compiled in this process
(launch.py's ``Kernel.origins``), so a phase can say which it did.
"""

from __future__ import annotations

import os
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Phase:
    name: str
    seconds: float
    detail: str = ""


@dataclass
class StartupClock:
    """Phases in order; ``mark(name)`` ends the current one."""

    origin: float = field(default_factory=time.perf_counter)
    before_origin_s: float | None = field(default_factory=lambda: process_age_s())
    phases: list[Phase] = field(default_factory=list)
    _last: float | None = None

    def mark(self, name: str, detail: str = "") -> float:
        """End phase ``name`` now; returns its seconds."""
        now = time.perf_counter()
        seconds = now - (self._last if self._last is not None else self.origin)
        self._last = now
        self.phases.append(Phase(name, seconds, detail))
        return seconds

    def elapsed_s(self) -> float:
        """Seconds since the process started (since the clock's creation where that is unknown)."""
        return time.perf_counter() - self.origin + (self.before_origin_s or 0.0)

    def line(self, first_token_s: float | None = None) -> str:
        """``interpreter 0.2 s, plan 0.3 s, ..., graph capture 0.4 s; first token 15.3 s after the process
        started`` (``first_token_s``: seconds since the clock's origin)."""
        parts = [] if self.before_origin_s is None else [f"interpreter {self.before_origin_s:.1f} s"]
        parts += [f"{phase.name} {phase.seconds:.1f} s" for phase in self.phases]
        text = ", ".join(parts)
        since = "the process started" if self.before_origin_s is not None else "memplan run started"
        if first_token_s is not None:
            text += f"; first token {first_token_s + (self.before_origin_s or 0.0):.1f} s after {since}"
        return text


def process_age_s() -> float | None:
    """Seconds since this process started (Linux: /proc), or None where unknown."""
    try:
        with open("/proc/self/stat") as stat:
            after_name = stat.read().rsplit(")", 1)[1].split()
        with open("/proc/uptime") as uptime:
            up = float(uptime.read().split()[0])
        return max(0.0, up - int(after_name[19]) / os.sysconf("SC_CLK_TCK"))  # field 22: starttime in ticks
    except (OSError, ValueError, IndexError):
        return None


@dataclass(frozen=True)
class KernelCensus:
    """Kernel specializations a model has prepared so far, by origin."""

    loaded: int  # from the persistent cache
    compiled: int  # compiled in this process

    @classmethod
    def of(cls, model: Any) -> KernelCensus:
        from executor.kernel_discovery import find_kernels

        origins = Counter(origin for kernel in find_kernels(model) for origin in kernel.origins.values())
        return cls(origins["cache"], origins["compiled"])

    def since(self, earlier: KernelCensus) -> KernelCensus:
        return KernelCensus(self.loaded - earlier.loaded, self.compiled - earlier.compiled)

    def text(self) -> str:
        return f"{self.loaded} kernels loaded from the cache, {self.compiled} compiled here"
