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

    def holds(batch: int) -> bool:
        at_batch = serving if batch == serving.max_batch else _with_batch(serving, batch)
        return at_batch is not None and drafter.holds(at_batch, batch, cap.max_context)

    return largest(holds, 1, MAX_BATCH, guess=draft.usable_kv_pages // cap.pages_per_request) or 0


def largest_context_at_batch(drafter: Drafter, draft: Draft) -> int:
    """Largest max_context (up to the model's limit) at which max_batch requests of it fit at once (0: none)."""
    serving, cap = draft.serving, draft.capacity
    guess = draft.usable_kv_pages // cap.max_batch * cap.page_size
    found = largest(lambda context: drafter.holds(serving, cap.max_batch, context), 1,
                    drafter.model.max_position_embeddings, guess=guess)
    return found or 0


def _with_batch(serving: ServingConfig, batch: int) -> ServingConfig | None:
    try:
        return serving_with(serving, max_batch=batch)
    except ValueError:
        return None
