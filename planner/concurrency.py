"""How many requests of max_context a plan holds at once, and how far its batch and context could go.

``max_concurrency`` is vLLM's "maximum concurrency": usable KV pages over the pages one request of
max_context takes, capped by max_batch and by the requests the recurrent-state slots hold. The largest
batch at this context and the largest context at this batch re-plan through drafts (their step buffers,
recurrent slots and graph pools grow with the knob), so each is a plan that holds that many requests.
"""

from __future__ import annotations

from typing import Any

from planner.config import ServingConfig, serving_with
from planner.draft import Draft, Drafter
from planner.kv_cache import kv_bytes_per_token
from planner.search import largest

#: ServingConfig's bound on max_batch: the largest batch the search tries.
MAX_BATCH = 1 << 16


def concurrency_fields(drafter: Drafter, draft: Draft) -> dict[str, Any]:
    """The capacity's concurrency answers for a draft that fits (``draft.holds(1)``)."""
    serving, cap = draft.serving, draft.capacity
    usable, per_request = draft.usable_kv_pages, cap.pages_per_request
    caps = [(usable / per_request, "kv_cache")]
    if cap.recurrent_slots:
        caps.append((cap.recurrent_slots // serving.states_per_slot, "recurrent_slots"))
    caps.append((cap.max_batch, "max_batch"))
    value, limit = min(caps, key=lambda item: item[0])  # ties: the first listed
    admitted = min(count for count, name in caps if name != "kv_cache")
    return {
        "kv_bytes_per_token": kv_bytes_per_token(draft.geometry, draft.dtypes.kv_cache),
        "max_concurrency": float(value),
        "concurrency_limit": limit,
        "kv_pages_beyond_batch": max(0, usable - admitted * per_request),
        "max_batch_at_context": largest_batch_at_context(drafter, draft),
        "max_context_at_batch": largest_context_at_batch(drafter, draft),
    }


def largest_batch_at_context(drafter: Drafter, draft: Draft) -> int:
    """Largest max_batch at which that many requests of this max_context fit at once (0: not even one)."""
    serving, cap = draft.serving, draft.capacity

    def at(batch: int) -> ServingConfig | None:
        return serving if batch == serving.max_batch else _with_batch(serving, batch)

    def holds(batch: int) -> bool:
        changed = at(batch)
        return changed is not None and drafter.holds(changed, batch, cap.max_context)

    other = min(2 * serving.max_batch, MAX_BATCH) if serving.max_batch < MAX_BATCH else serving.max_batch // 2
    changed = at(other)
    guess = draft.usable_kv_pages // cap.pages_per_request
    if changed is not None:
        guess = _crossing(serving.max_batch, _pages(draft), other, _pages(drafter.draft_or_none(changed)),
                          cap.pages_per_request, guess)
    return largest(holds, 1, MAX_BATCH, guess=guess) or 0


def largest_context_at_batch(drafter: Drafter, draft: Draft) -> int:
    """Largest max_context (up to the model's limit) at which max_batch requests of it fit at once (0: none)."""
    return largest_context_holding(drafter, draft, draft.capacity.max_batch, drafter.model.max_position_embeddings) or 0


def largest_context_holding(drafter: Drafter, draft: Draft, requests: int, high: int) -> int | None:
    """Largest max_context up to ``high`` at which ``requests`` requests of it fit at once, at ``draft``'s
    other settings; None when not even one token's does."""
    serving, cap = draft.serving, draft.capacity
    if high < 1:
        return None
    other = cap.max_context // 2 if cap.max_context > 1 else 2
    guess = draft.usable_kv_pages // requests * cap.page_size
    if other <= drafter.model.max_position_embeddings:
        guess = _crossing(cap.max_context, _pages(draft), other,
                          _pages(drafter.draft_or_none(serving, other)), requests / cap.page_size, guess)

    def fits(context: int) -> bool:
        return drafter.holds(serving, requests, context)

    # In whole pages first (the answer nearly always ends a page), then the tokens of the page after.
    size = cap.page_size
    pages = largest(lambda n: fits(n * size), 1, high // size, guess=max(1, guess // size))
    if pages is None:
        return largest(fits, 1, min(high, size - 1))
    beyond = largest(fits, pages * size + 1, min(high, pages * size + size - 1), guess=pages * size + 1)
    return beyond or pages * size


def _pages(draft: Draft | None) -> float | None:
    """KV pages the bytes left over would hold, negative when the non-KV pools overflow (a smooth figure to
    fit a line through, unlike the pool's whole pages)."""
    return None if draft is None else draft.available_bytes / draft.page_bytes - 1


def _crossing(x1: int, y1: float | None, x2: int, y2: float | None, need_per_unit: float, fallback: int) -> int:
    """Where a line through (x1, y1) and (x2, y2), pages left at knob value x, meets need_per_unit x pages
    needed: the guess that starts the search (``fallback`` when the two points give no line)."""
    if y1 is None or y2 is None or x1 == x2:
        return fallback
    slope = (y1 - y2) / (x2 - x1)  # pages each unit of the knob costs
    if need_per_unit + slope <= 0:
        return fallback
    return max(1, int((y1 + slope * x1) / (need_per_unit + slope)))


def _with_batch(serving: ServingConfig, batch: int) -> ServingConfig | None:
    try:
        return serving_with(serving, max_batch=batch)
    except ValueError:
        return None
