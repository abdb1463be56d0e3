"""Shared test harness: tiny models planned for the simulator, loaded from HF."""

from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch

from executor.arena import Arena, materialize
from executor.device import open_device
from executor.models import build_model
from executor.models.context import StepViews
from executor.models.decoder import DecoderModel
from executor.step import RequestChunk, plan_step
from executor.weights import load_state_dict
from planner.config import ModelConfig
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import MemoryPlan, build_plan
from tests.hf_reference import hf_model


@dataclass
class Loaded:
    plan: MemoryPlan
    arena: Arena
    model: DecoderModel
    hf: torch.nn.Module


def load_tiny(name: str | ModelConfig, seed: int = 0, **serving) -> Loaded:
    """Plan ``name`` for the simulator, materialize it and load a random HF model's weights."""
    return load_with_hf(name, "cpu-sim", "sim", seed=seed, **serving)


def load_with_hf(name: str | ModelConfig, hardware: str, serving_name: str, *, seed: int = 0,
                 dtype: str | None = None, **serving) -> Loaded:
    """Plan ``name`` (a shipped name, a file, or a config built by the test) on ``hardware``, materialize
    it on the available device, and load the weights of a randomly initialised HF model of the same
    shape (built on that device)."""
    config = load_model(name) if isinstance(name, str) else name
    if dtype is not None:
        serving["dtype"] = dtype
    plan = build_plan(config, load_hardware(hardware), load_serving(serving_name, serving))
    device = open_device("auto")
    arena = materialize(plan, device)
    torch_dtype = getattr(torch, plan.dtypes.weights)
    hf = hf_model(config, seed=seed, device=str(device.torch_device), dtype=torch_dtype)
    load_state_dict(arena, hf.state_dict())
    return Loaded(plan, arena, build_model(arena), hf)


@functools.cache
def shared_tiny(name: str) -> Loaded:
    """``load_tiny(name)``, loaded once per session for the tests that only run it (each step resets the
    recurrent slots it uses and writes every KV position before reading it, so tests do not see each other).
    Qwen3.5's (1 + w) norms, which HF initialises at w = 0, get values so the offset is exercised."""
    loaded = load_tiny(name)
    if loaded.plan.model.architecture != "qwen3":
        perturb_norms(loaded)
    return loaded


def perturb_norms(loaded: Loaded) -> None:
    """Add seeded noise to every ``*norm.weight`` of the HF model and load the result into the arena."""
    state = loaded.hf.state_dict()
    generator = torch.Generator().manual_seed(3)
    for name, tensor in state.items():
        if name.endswith("norm.weight"):
            tensor.copy_(tensor + 0.1 * torch.randn(tensor.shape, generator=generator))
    loaded.hf.load_state_dict(state)
    load_state_dict(loaded.arena, state)


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


@dataclass
class TeacherForced:
    """One teacher-forced run of a shared model: requests prefilled in one pass, batched, then decoded."""

    loaded: Loaded
    sequences: list[list[int]]
    prompts: list[int]
    decode_steps: list[int]
    logits: list[list[torch.Tensor]]  # per request: after its prompt, then after each fed token
    touched: dict[str, set[str]] = field(default_factory=dict)  # step pool -> roles StepViews handed out


#: name -> (prompt lengths, decode steps per request, seed). The first request of every model is
#: prefilled in one pass and then fed 8 teacher-forced decode steps; the second, shorter one shares
#: the prefill step and the first decode steps (batched rows of different lengths and page tables).
REFERENCE_RUNS = {
    "tiny-qwen3": ([5, 3], [8, 3], 1),
    "tiny-qwen3-g5": ([5, 3], [8, 3], 1),
    "tiny-qwen3.5": ([7, 2], [8, 3], 4),
    "tiny-qwen3.5-g6": ([6, 2], [8, 3], 4),
}


@functools.cache
def reference_run(name: str) -> TeacherForced:
    """The teacher-forced run of ``shared_tiny(name)`` given by REFERENCE_RUNS, run once per session and
    shared: against HF (test_qwen3*_vs_hf), as the one-pass prefill chunked prefill must equal, and for
    the transient buffers its prefill and decode steps touch (test_step_buffers)."""
    prompts, decode_steps, seed = REFERENCE_RUNS[name]
    loaded = shared_tiny(name)
    sequences = random_sequences(loaded.plan.model.vocab_size, [p + d for p, d in zip(prompts, decode_steps)], seed)
    touched: dict[str, set[str]] = {"decode": set(), "prefill": set()}
    originals = {"role": StepViews.role, "scratch": StepViews.scratch}

    def recorder(original):
        def recording(self, role):
            touched[self.pool].add(role)
            return original(self, role)
        return recording

    for method, original in originals.items():
        setattr(StepViews, method, recorder(original))
    try:
        logits = run_teacher_forced(loaded, sequences, prompts)
    finally:
        for method, original in originals.items():
            setattr(StepViews, method, original)
    return TeacherForced(loaded, sequences, prompts, decode_steps, logits, touched)


def assert_teacher_forced_matches_hf(run: TeacherForced, tolerance: float) -> None:
    """Every step's logits of ``run`` (after the prompt and after each fed token) within ``tolerance``
    of HF's (max abs difference over max abs HF logit)."""
    name = run.loaded.plan.model.name
    for r, (seq, prompt, steps, logits) in enumerate(zip(run.sequences, run.prompts, run.decode_steps, run.logits)):
        reference = hf_logits(run.loaded.hf, seq)[prompt - 1 :]
        assert len(logits) == reference.shape[0] == steps + 1
        for step, (mine, theirs) in enumerate(zip(logits, reference)):
            error = float((mine - theirs).abs().max() / theirs.abs().max())
            assert error <= tolerance, f"{name} request {r} step {step}: relative error {error:.2e}"


# ---------------------------------------------------------------- decode steps of prefilled requests


def prefilled_requests(loaded: Loaded, prompt_lens: list[int], seed: int) -> list[RequestChunk]:
    """Prefill one request per prompt (request r on slot r, its own pages); return each request's
    next decode chunk (its greedy next token)."""
    plan = loaded.plan
    pages_each = plan.capacity.pages_per_request
    prompts = random_sequences(plan.model.vocab_size, prompt_lens, seed)
    pages = [list(range(1 + r * pages_each, 1 + (r + 1) * pages_each)) for r in range(len(prompts))]
    for slot in range(len(prompts)):
        loaded.model.reset_slot(slot)
    chunks = [RequestChunk(p, 0, pages[r], slot=r) for r, p in enumerate(prompts)]
    sampled = loaded.model.step(plan_step(plan, chunks)).tolist()
    return [RequestChunk([token], len(p), pages[r], slot=r) for r, (p, token) in enumerate(zip(prompts, sampled))]


def decode_state(loaded: Loaded) -> dict[str, torch.Tensor]:
    """Copies of what decode steps write: the KV cache and (Qwen3.5) the recurrent state."""
    pools = [("kv_cache", "kv_cache")]
    if loaded.plan.geometry.num_linear_layers:
        pools += [("recurrent_state", "ssm_state"), ("recurrent_state", "conv_state")]
    return {name: loaded.arena.tensor(pool, name).clone() for pool, name in pools}


def restore_decode_state(loaded: Loaded, state: dict[str, torch.Tensor]) -> None:
    """Put back a ``decode_state`` copy, so another run starts from the same cache."""
    for name, saved in state.items():
        pool = "kv_cache" if name == "kv_cache" else "recurrent_state"
        loaded.arena.tensor(pool, name).copy_(saved)


def greedy_decode(loaded: Loaded, chunks: list[RequestChunk], steps: int, pad_to: int | None = None):
    """``steps`` greedy decode steps; returns the logits [steps, B, V] and tokens [steps, B]."""
    logits, tokens = [], []
    for _ in range(steps):
        sampled = loaded.model.step(plan_step(loaded.plan, chunks), pad_to=pad_to).tolist()
        logits.append(loaded.model.logits(len(chunks)).clone())
        tokens.append(sampled)
        chunks = [RequestChunk([t], c.num_cached + 1, c.page_ids, slot=c.slot) for c, t in zip(chunks, sampled)]
    return torch.stack(logits), tokens
