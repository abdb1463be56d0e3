"""The largest integer at which a monotone predicate holds: how the planner answers "how far can this knob go"
by re-planning instead of by an approximate formula."""

from __future__ import annotations

from collections.abc import Callable


def largest(holds: Callable[[int], bool], low: int, high: int, guess: int | None = None) -> int | None:
    """Largest v in [low, high] with holds(v), or None; ``holds`` must be true below a threshold and false
    above it. ``guess`` (clamped into the range) starts a galloping search there, so a close guess costs a
    few calls instead of log2(high - low)."""
    if high < low:
        return None
    start = low if guess is None else min(max(guess, low), high)
    if holds(start):
        good, step = start, 1  # gallop up from a value that holds
        while good + step <= high and holds(good + step):
            good, step = good + step, step * 2
        bad = min(good + step, high + 1)
    else:
        bad, step = start, 1  # gallop down from a value that does not
        while bad - step >= low and not holds(bad - step):
            bad, step = bad - step, step * 2
        if bad - step < low:
            if bad == low or not holds(low):
                return None
            good = low
        else:
            good = bad - step
    while bad - good > 1:  # holds(good), not holds(bad) (or bad = high + 1)
        middle = (good + bad) // 2
        if holds(middle):
            good = middle
        else:
            bad = middle
    return good
