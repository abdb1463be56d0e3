"""A small greedy generation loop over one materialized plan.

Requests are admitted in waves of at most ``max_batch`` (and as many as the
KV pool's pages hold); each gets a contiguous range of KV pages (page 0 is the
padding page) and a recurrent-state slot. A wave runs chunked prefill (at most
``max_prefill_tokens`` prompt tokens per step, a prompt may span several
steps), then decode steps feeding every request its last sampled token, until
each request has ``max_new_tokens`` tokens. The sampled ids are read back once
per step: that is the only host synchronisation.

Not a scheduler: no continuous batching, no prefix sharing, no stop tokens.
Everything is validated against the plan before the first step runs.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from executor.device import Device
from executor.models.decoder import DecoderModel
from executor.step import CapacityError, RequestChunk, plan_step
from planner.plan import MemoryPlan


class PromptError(ValueError):
    """A prompt is empty or holds an id outside the vocabulary, or max_new_tokens < 1."""


class RequestCapacityError(CapacityError):
    """One request needs more than a planned limit, whatever else runs with it."""

    def __init__(self, request: int, dimension: str, required: int, capacity: int, detail: str):
        super().__init__(dimension, required, capacity, detail)
        self.request = request
        self.args = (f"request {request}: {dimension}: needs {required:,}, plan has {capacity:,} ({detail})",)


@dataclass(frozen=True)
class Request:
    """One admitted request: its index in the input, its prompt, its pages and slot."""

    index: int
    prompt: Sequence[int]
    page_ids: Sequence[int]
    slot: int


@dataclass
class GenerationResult:
    """Generated ids per request (input order) and what the run measured."""

    outputs: list[list[int]]
    waves: int = 0
    prefill_tokens: int = 0
    prefill_seconds: float = 0.0
    decode_step_seconds: list[float] = field(default_factory=list)
    #: device allocations between the end of the first decode step and the end (None: not measured)
    allocations_after_warmup: int | None = None
    _allocations_baseline: int | None = field(default=None, repr=False)

    @property
    def prefill_tokens_per_s(self) -> float:
        return self.prefill_tokens / self.prefill_seconds if self.prefill_seconds > 0 else float("nan")

    @property
    def decode_tpot_ms(self) -> float:
        """Median wall time of one decode step (all running requests, one token each), ms."""
        return statistics.median(self.decode_step_seconds) * 1e3 if self.decode_step_seconds else float("nan")


def pages_needed(plan: MemoryPlan, prompt_len: int, max_new_tokens: int) -> int:
    """KV pages one request holds: ceil((prompt + max_new_tokens) / page_size)."""
    return -(-(prompt_len + max_new_tokens) // plan.capacity.page_size)


def validate_requests(plan: MemoryPlan, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> None:
    """Raise PromptError or RequestCapacityError naming the first request that cannot run on this plan."""
    if max_new_tokens < 1:
        raise PromptError(f"max_new_tokens must be >= 1, got {max_new_tokens}")
    if not prompts:
        raise PromptError("no prompts")
    cap, vocab = plan.capacity, plan.model.vocab_size
    usable_pages = cap.kv_pages - 1  # page 0 is the padding page
    for index, prompt in enumerate(prompts):
        if not prompt:
            raise PromptError(f"request {index}: empty prompt")
        bad = [t for t in prompt if not isinstance(t, int) or isinstance(t, bool) or not 0 <= t < vocab]
        if bad:
            raise PromptError(f"request {index}: token id {bad[0]!r} is not an int in [0, {vocab})")
        context = len(prompt) + max_new_tokens
        if context > cap.max_context:
            raise RequestCapacityError(index, "max_context", context, cap.max_context,
                                       f"{len(prompt)} prompt + {max_new_tokens} new tokens")
        pages = pages_needed(plan, len(prompt), max_new_tokens)
        if pages > usable_pages:
            raise RequestCapacityError(index, "usable KV pages", pages, usable_pages,
                                       f"{context} tokens at page_size {cap.page_size}; the pool has "
                                       f"{cap.kv_pages} pages, page 0 is padding")


def plan_waves(plan: MemoryPlan, prompts: Sequence[Sequence[int]], max_new_tokens: int) -> list[list[Request]]:
    """Split the requests, in order, into waves of at most max_batch that fit the KV pool together."""
    cap = plan.capacity
    waves: list[list[Request]] = []
    wave: list[Request] = []
    next_page = 1
    for index, prompt in enumerate(prompts):
        pages = pages_needed(plan, len(prompt), max_new_tokens)
        if len(wave) == cap.max_batch or next_page + pages > cap.kv_pages:
            waves.append(wave)
            wave, next_page = [], 1
        wave.append(Request(index, list(prompt), range(next_page, next_page + pages), slot=len(wave)))
        next_page += pages
    waves.append(wave)
    return waves


def generate(model: DecoderModel, plan: MemoryPlan, prompts: Sequence[Sequence[int]], max_new_tokens: int,
             *, warmup: bool = False) -> GenerationResult:
    """Greedy-generate ``max_new_tokens`` ids for every prompt; see the module docstring.

    ``warmup`` runs one throw-away two-token prefill and one decode step first (not
    timed), so that kernel compilation on a GPU is not counted as prefill time.
    """
    validate_requests(plan, prompts, max_new_tokens)
    result = GenerationResult(outputs=[[] for _ in prompts])
    if warmup:
        _warm_up(model, plan)
    for wave in plan_waves(plan, prompts, max_new_tokens):
        _run_wave(model, plan, wave, max_new_tokens, result)
        result.waves += 1
    return result


def _run_wave(model: DecoderModel, plan: MemoryPlan, wave: list[Request], max_new_tokens: int,
              result: GenerationResult) -> None:
    for request in wave:
        model.reset_slot(request.slot)
    _prefill(model, plan, wave, result)
    for _ in range(max_new_tokens - 1):
        chunks = [RequestChunk([result.outputs[r.index][-1]], len(r.prompt) + len(result.outputs[r.index]) - 1,
                               r.page_ids, r.slot) for r in wave]
        sampled, seconds = _timed_step(model, plan, chunks)
        result.decode_step_seconds.append(seconds)
        for request, token in zip(wave, sampled):
            result.outputs[request.index].append(token)
        _count_allocations(model.device, result)


def _prefill(model: DecoderModel, plan: MemoryPlan, wave: list[Request], result: GenerationResult) -> None:
    """Chunked prefill of a wave; a request's first output is sampled after its last prompt chunk."""
    cached = {r.index: 0 for r in wave}
    while any(cached[r.index] < len(r.prompt) for r in wave):
        chunks, finishing = _prefill_chunks(wave, cached, plan.capacity.max_prefill_tokens)
        sampled, seconds = _timed_step(model, plan, chunks)
        result.prefill_seconds += seconds
        result.prefill_tokens += sum(len(c.token_ids) for c in chunks)
        for position, request in finishing:
            result.outputs[request.index].append(sampled[position])


def _prefill_chunks(wave: list[Request], cached: dict[int, int], budget: int
                    ) -> tuple[list[RequestChunk], list[tuple[int, Request]]]:
    """The next prefill step: prompt chunks up to ``budget`` tokens in all; advances ``cached``.

    Returns the chunks and, for each request whose prompt ends in this step, its position in the step.
    """
    chunks: list[RequestChunk] = []
    finishing: list[tuple[int, Request]] = []
    for request in wave:
        start = cached[request.index]
        if start >= len(request.prompt) or budget == 0:
            continue
        end = min(len(request.prompt), start + budget)
        chunks.append(RequestChunk(request.prompt[start:end], start, request.page_ids, request.slot))
        if end == len(request.prompt):
            finishing.append((len(chunks) - 1, request))
        cached[request.index] = end
        budget -= end - start
    return chunks, finishing


def _timed_step(model: DecoderModel, plan: MemoryPlan, chunks: list[RequestChunk]) -> tuple[list[int], float]:
    """Run one step and read back its sampled ids (the step's one host sync); return them and the wall time.

    The time covers the host metadata, the forward and the read-back.
    """
    model.device.synchronize()
    start = time.perf_counter()
    sampled = model.step(plan_step(plan, chunks)).tolist()
    model.device.synchronize()
    return sampled, time.perf_counter() - start


def _count_allocations(device: Device, result: GenerationResult) -> None:
    """Start counting device allocations after the first decode step; keep the running difference."""
    if device.is_sim:
        return
    count = torch.cuda.memory_stats(device.torch_device)["allocation.all.allocated"]
    if result._allocations_baseline is None:
        result._allocations_baseline = count
    result.allocations_after_warmup = count - result._allocations_baseline


def _warm_up(model: DecoderModel, plan: MemoryPlan) -> None:
    """One two-token prefill and one decode step on page 1 and slot 0 (both reset before real use)."""
    pages = range(1, 1 + pages_needed(plan, 2, 1))
    model.reset_slot(0)
    model.step(plan_step(plan, [RequestChunk([0, 0], 0, pages, 0)])).tolist()
    model.step(plan_step(plan, [RequestChunk([0], 2, pages, 0)])).tolist()
    model.device.synchronize()
