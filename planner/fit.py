"""Why a plan does not fit, and which serving knob would make it fit.

A plan fits when its KV pool holds one request of max_context (``Draft.holds``). When it does not, the
error names the largest max_context that fits at these settings and the smallest gpu_memory_utilization
(in steps of 0.01) that fits this max_context, then any other single knob (a smaller batch, prefill chunk
or count of recurrent-state snapshots, more tensor parallelism) that fits. Where no max_context fits at
these settings (the pools beside the KV cache fill the device: Qwen3.5's recurrent state grows with the
batch) and no smaller batch fits this one, it names the largest max_context at smaller batches. Every
value comes from re-planning through drafts of the same layout as the failure, never from an approximate
formula, so applying it gives a plan that fits.
"""

from __future__ import annotations

import math
from fractions import Fraction

from pydantic import ValidationError

from planner.concurrency import largest_batch_at_context, largest_context_holding
from planner.config import ServingConfig, serving_with
from planner.draft import Draft, Drafter, kv_pool_bytes
from planner.errors import PlanDoesNotFit
from planner.report import format_bytes
from planner.search import largest

#: gpu_memory_utilization advice is in hundredths (vLLM users write 0.92, not 0.9137).
HUNDREDTHS = 100
TENSOR_PARALLEL_SIZES = (2, 4, 8, 16, 32, 64)
#: Where no max_context fits at these settings, the batches tried for one that does: max_batch halved, down
#: to 1, and the first two that fit a context are named (a trade-off of batch against context, not a sweep).
SMALLER_BATCHES_NAMED = 2


def explain_does_not_fit(drafter: Drafter, draft: Draft) -> PlanDoesNotFit:
    """A PlanDoesNotFit for a draft whose KV pool cannot hold one request of its max_context."""
    model, hardware, serving = drafter.model, drafter.hardware, draft.serving
    cap = draft.capacity
    needed = draft.pages_needed(1)
    required = draft.non_kv_bytes + kv_pool_bytes(needed + 1, draft.page_bytes)
    usable = (f"the usable {format_bytes(draft.usable_bytes)} ({serving.gpu_memory_utilization:g} x "
              f"{format_bytes(hardware.device_memory_bytes)})")
    if draft.available_bytes < 0:
        left = f"the non-KV pools alone need {format_bytes(draft.non_kv_bytes)} of {usable}"
    else:
        left = (f"{usable} less the non-KV pools' {format_bytes(draft.non_kv_bytes)} leaves "
                f"{draft.usable_kv_pages:,} pages ({draft.usable_kv_pages * cap.page_size:,} tokens)")
    biggest = sorted(draft.pools, key=lambda p: -p.bytes)[:3]
    auto = " (auto: not even the shortest context fits)" if serving.max_context == "auto" else ""
    advice: dict[str, object] = {}
    parts = [
        f"{model.name} on {hardware.name} does not fit one request of max_context {cap.max_context:,}{auto}: it "
        f"needs {needed:,} KV pages of {format_bytes(draft.page_bytes)} (+1 padding page), "
        f"{format_bytes(required)} in all; {left}",
        "Biggest: " + ", ".join(f"{p.name} {format_bytes(p.bytes)}" for p in biggest),
    ]
    knobs = _other_knobs(drafter, serving, cap.max_context)
    context = _largest_context(drafter, draft) if serving.max_context != "auto" else None
    if context is not None:
        advice["max_context"] = context
        beyond = (" (past the tokens left above: the pools sized by max_context shrink with it)"
                  if context > draft.usable_kv_pages * cap.page_size else "")
        parts.append(f"Largest max_context that fits at these settings: --max-model-len {context}{beyond}")
    else:
        parts.append("No max_context fits at these settings")
        smaller = [] if "max_batch" in knobs else _contexts_at_smaller_batches(drafter, serving, cap.max_context)
        if smaller:
            advice["at_smaller_batch"] = smaller
            parts.append("At a smaller batch: " + "; or ".join(
                f"--max-batch {pair['max_batch']} --max-model-len {pair['max_context']}" for pair in smaller))
    utilization = _smallest_utilization(drafter, draft, required)
    if utilization is not None:
        advice["gpu_memory_utilization"] = utilization
        parts.append(f"gpu_memory_utilization that fits max_context {cap.max_context:,}: "
                     f"--gpu-memory-utilization {utilization:g} (now {serving.gpu_memory_utilization:g})")
    else:
        parts.append(f"No gpu_memory_utilization up to 1 fits max_context {cap.max_context:,}")
    advice.update(knobs)
    others = [f"--{knob.replace('_', '-')} {value} (now {getattr(serving, knob)}"
              f"{_held_at_once(drafter, serving, knob, value)})" for knob, value in advice.items()
              if knob not in ("max_context", "gpu_memory_utilization", "at_smaller_batch")]
    if others:
        parts.append("Also fits: " + "; or ".join(others))
    return PlanDoesNotFit(". ".join(parts) + ".", required_bytes=required, usable_bytes=draft.usable_bytes,
                          advice=advice)


def _largest_context(drafter: Drafter, draft: Draft) -> int | None:
    """Largest max_context below this one of which one request fits, at otherwise unchanged settings."""
    return largest_context_holding(drafter, draft, 1, draft.capacity.max_context - 1)


def _smallest_utilization(drafter: Drafter, draft: Draft, required_bytes: int) -> float | None:
    """Smallest multiple of 0.01 above serving gpu_memory_utilization at which this max_context fits."""
    serving = draft.serving
    lowest = math.floor(Fraction(repr(serving.gpu_memory_utilization)) * HUNDREDTHS) + 1
    if lowest > HUNDREDTHS:
        return None

    def fits(below_one: int) -> bool:  # true from some utilization up to 1: search down from 1
        changed = _changed(serving, gpu_memory_utilization=(HUNDREDTHS - below_one) / HUNDREDTHS)
        return changed is not None and drafter.holds(changed, 1, draft.capacity.max_context)

    estimate = -(-required_bytes * HUNDREDTHS // drafter.hardware.device_memory_bytes)
    below = largest(fits, 0, HUNDREDTHS - lowest, guess=HUNDREDTHS - estimate)
    return None if below is None else (HUNDREDTHS - below) / HUNDREDTHS


def _held_at_once(drafter: Drafter, serving: ServingConfig, knob: str, value: object) -> str:
    """For an advised max_batch whose KV pool holds fewer of its requests of max_context at once than it
    admits (a recurrent state a request, as Qwen3.5 keeps, takes memory from the KV pool): how many it holds,
    and the largest batch that holds all of its own; empty otherwise."""
    if knob != "max_batch" or (changed := _changed(serving, max_batch=value)) is None:
        return ""
    draft = drafter.draft(changed)
    held = draft.usable_kv_pages // draft.capacity.pages_per_request
    if held >= value:
        return ""
    every = largest_batch_at_context(drafter, draft)
    return (f"; it holds {held:,} request{'s' * (held != 1)} of max_context at once, --max-batch {every} "
            f"holds {every}")


def _contexts_at_smaller_batches(drafter: Drafter, serving: ServingConfig, high: int) -> list[dict[str, int]]:
    """The largest max_context (up to ``high``) at max_batch halved, then halved again, ...: the first
    ``SMALLER_BATCHES_NAMED`` batches at which one fits."""
    found: list[dict[str, int]] = []
    batch = serving.max_batch // 2
    while batch >= 1 and len(found) < SMALLER_BATCHES_NAMED:
        changed = _changed(serving, max_batch=batch)
        draft = None if changed is None else drafter.draft_or_none(changed, high)
        context = None if draft is None else largest_context_holding(drafter, draft, 1, high)
        if context is not None:
            found.append({"max_batch": batch, "max_context": context})
            if context == high:
                break
        batch //= 2
    return found


def _other_knobs(drafter: Drafter, serving: ServingConfig, context: int) -> dict[str, object]:
    """Other single knobs that fit: the largest smaller max_batch, max_prefill_tokens and (with recurrent
    layers) prefix_state_slots, the smallest larger tensor_parallel_size."""
    found: dict[str, object] = {}
    knobs = [("max_batch", 1), ("max_prefill_tokens", 1)]
    if drafter.model.linear_attention is not None and serving.prefix_state_slots:
        knobs.append(("prefix_state_slots", 0))
    for knob, lowest in knobs:
        current = getattr(serving, knob)

        def fits(value: int, knob: str = knob) -> bool:
            changed = _changed(serving, **{knob: value})
            return changed is not None and drafter.holds(changed, 1, context)

        best = largest(fits, lowest, current - 1)
        if best is not None:
            found[knob] = best
    for tp in TENSOR_PARALLEL_SIZES:
        if tp > serving.tensor_parallel_size:
            changed = _changed(serving, tensor_parallel_size=tp)
            if changed is not None and drafter.holds(changed, 1, context):
                found["tensor_parallel_size"] = tp
                break
    return found


def _changed(serving: ServingConfig, **change: object) -> ServingConfig | None:
    try:
        return serving_with(serving, **change)
    except ValidationError:
        return None
