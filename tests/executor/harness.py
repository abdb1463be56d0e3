"""Shared test harness: tiny models planned for the simulator, loaded from HF."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from executor.arena import Arena, materialize
from executor.device import open_device
from executor.models import build_model
from executor.models.decoder import DecoderModel
from executor.step import RequestChunk, plan_step
from executor.weights import load_state_dict
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import MemoryPlan, build_plan
from tests.hf_reference import hf_model


@dataclass
class Loaded:
    plan: MemoryPlan
    arena: Arena
    model: DecoderModel
    hf: torch.nn.Module


def load_tiny(name: str, seed: int = 0, **serving) -> Loaded:
    """Plan ``name`` for the simulator, materialize it and load a random HF model's weights."""
    return load_with_hf(name, "cpu-sim", "sim", seed=seed, **serving)


def load_with_hf(name: str, hardware: str, serving_name: str, *, seed: int = 0, dtype: str | None = None,
                 **serving) -> Loaded:
    """Plan ``name`` on ``hardware``, materialize it on the available device, and load the
    weights of a randomly initialised HF model of the same shape (built on that device)."""
    config = load_model(name)
    if dtype is not None:
        serving["dtype"] = dtype
    plan = build_plan(config, load_hardware(hardware), load_serving(serving_name, serving))
    device = open_device("auto")
    arena = materialize(plan, device)
    torch_dtype = getattr(torch, plan.dtypes.weights)
    hf = hf_model(config, seed=seed, device=str(device.torch_device), dtype=torch_dtype)
    load_state_dict(arena, hf.state_dict())
    return Loaded(plan, arena, build_model(arena), hf)


def hf_logits(hf: torch.nn.Module, ids: list[int]) -> torch.Tensor:
    """HF's float32 logits at every position of ``ids`` [len(ids), V]."""
    device = next(hf.parameters()).device
    with torch.no_grad():
        return hf(torch.tensor([ids], device=device)).logits[0].float()


def run_teacher_forced(loaded: Loaded, sequences: list[list[int]], prompt_lens: list[int], chunk: int | None = None,
                       first_page: int = 1) -> list[list[torch.Tensor]]:
    """Prefill each sequence's prompt (in chunks of ``chunk`` tokens), then feed its remaining
    tokens one decode step at a time, all requests batched. Returns per request the logits
    after its prompt and after each fed token."""
    page_size = loaded.plan.capacity.page_size
    pages_each = loaded.plan.capacity.pages_per_request
    pages = [list(range(first_page + i * pages_each, first_page + (i + 1) * pages_each)) for i in range(len(sequences))]
    cached = [0] * len(sequences)
    for slot in range(len(sequences)):
        loaded.model.reset_slot(slot)
    logits: list[list[torch.Tensor]] = [[] for _ in sequences]
    assert page_size > 0
    while any(c < len(s) for c, s in zip(cached, sequences)):
        chunks, owners = [], []
        budget = loaded.plan.capacity.max_tokens_per_step
        for r, seq in enumerate(sequences):
            if cached[r] >= len(seq) or budget <= 0:
                continue
            if cached[r] < prompt_lens[r]:
                end = prompt_lens[r] if chunk is None else min(prompt_lens[r], cached[r] + chunk)
                end = min(end, cached[r] + budget)
            else:
                end = cached[r] + 1
            budget -= end - cached[r]
            chunks.append(RequestChunk(seq[cached[r]:end], cached[r], pages[r], slot=r))
            owners.append((r, end))
        loaded.model.step(plan_step(loaded.plan, chunks))
        step_logits = loaded.model.logits(len(chunks)).clone()
        for i, (r, end) in enumerate(owners):
            if end >= prompt_lens[r]:
                logits[r].append(step_logits[i])
            cached[r] = end
    return logits


def random_sequences(vocab: int, lengths: list[int], seed: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=generator).tolist() for n in lengths]


def assert_teacher_forced_matches_hf(loaded: Loaded, prompts: list[int], decode_steps: int, tolerance: float,
                                     seed: int) -> None:
    """Prefill each prompt, feed ``decode_steps`` more tokens; every step's logits within
    ``tolerance`` of HF's (max abs difference over max abs HF logit)."""
    sequences = random_sequences(loaded.plan.model.vocab_size, [p + decode_steps for p in prompts], seed)
    ours = run_teacher_forced(loaded, sequences, prompts)
    for seq, prompt, logits in zip(sequences, prompts, ours):
        reference = hf_logits(loaded.hf, seq)[prompt - 1 :]
        assert len(logits) == reference.shape[0] == decode_steps + 1
        for step, (mine, theirs) in enumerate(zip(logits, reference)):
            error = float((mine - theirs).abs().max() / theirs.abs().max())
            assert error <= tolerance, f"{loaded.plan.model.name} step {step}: relative error {error:.2e}"
