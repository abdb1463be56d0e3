"""GPU gates (H200): HF golden log-probs in bf16 and float32, pointer stability,
zero allocations after warm-up, planned vs allocated bytes."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from executor.step import RequestChunk, plan_step
from tests.executor.harness import hf_logits, load_with_hf, run_teacher_forced

pytestmark = pytest.mark.gpu


def _prompts(vocab: int, count: int, longest: int, extra: int, seed: int, long_prompts: int = 0):
    generator = torch.Generator().manual_seed(seed)
    lengths = torch.randint(1, longest + 1, (count,), generator=generator).tolist() + [4097] * long_prompts
    return [torch.randint(0, vocab, (n + extra,), generator=generator).tolist() for n in lengths], lengths


def _logprob_deltas(loaded, sequences, prompt_lens, chunk=None) -> np.ndarray:
    """|log p_ours(t*) - log p_HF(t*)| at HF's top token t*, at every teacher-forced position."""
    ours = run_teacher_forced(loaded, sequences, prompt_lens, chunk=chunk)
    deltas = []
    for seq, prompt, mine in zip(sequences, prompt_lens, ours):
        reference = hf_logits(loaded.hf, seq)[prompt - 1 :]
        theirs = torch.log_softmax(reference, -1)
        top = theirs.argmax(-1)
        mine_lp = torch.log_softmax(torch.stack(mine).float(), -1)
        deltas.append((mine_lp.gather(1, top[:, None]) - theirs.gather(1, top[:, None])).abs().flatten().cpu())
    return torch.cat(deltas).numpy()


def _gate(deltas: np.ndarray, mean: float, p99: float, label: str) -> None:
    summary = f"{label}: mean {deltas.mean():.4f}, p99 {np.percentile(deltas, 99):.4f}, max {deltas.max():.4f}, n {deltas.size}"
    print(summary)
    assert deltas.mean() <= mean and np.percentile(deltas, 99) <= p99, summary


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-0.8b"])
def test_pointers_stay_and_nothing_allocates_after_warm_up(name):
    loaded = load_with_hf(name, "h200", "default", max_batch=8, max_context=1024, max_prefill_tokens=512,
                          gpu_memory_utilization=0.25)
    arena, plan = loaded.arena, loaded.plan
    materialized = sum(p.bytes for p in plan.pools if p.materialized)
    pointers = {key: view.data_ptr() for key, view in arena._views.items()}
    shapes = [(1, 5), (3, 40), (8, 1), (2, 700), (5, 17), (8, 1000)]  # (requests, context)

    def run(batch: int, context: int) -> None:
        pages = plan.capacity.pages_per_request
        chunks = [RequestChunk([1], context - 1, list(range(1 + r * pages, 1 + (r + 1) * pages)), slot=r)
                  for r in range(batch)]
        for r in range(batch):
            loaded.model.reset_slot(r)
        loaded.model.step(plan_step(plan, chunks)).tolist()

    run(*shapes[0])
    run(2, 300)
    torch.cuda.synchronize()
    stats = torch.cuda.memory_stats()
    allocations, free_before = stats["allocation.all.allocated"], torch.cuda.mem_get_info()[0]
    for batch, context in shapes * 3:
        run(batch, context)
    torch.cuda.synchronize()
    grown = torch.cuda.memory_stats()["allocation.all.allocated"] - allocations
    free_after = torch.cuda.mem_get_info()[0]
    print(f"allocations after warm-up: {grown}; device free bytes changed by {free_before - free_after}")
    print(f"arena {arena.allocated_bytes} B, plan materialized {materialized} B, "
          f"torch allocated {torch.cuda.memory_allocated()} B")
    assert grown == 0
    assert free_after == free_before
    assert {key: view.data_ptr() for key, view in arena._views.items()} == pointers
    assert arena.allocated_bytes == materialized


#: serving prefill_attention flash, with chunks of >= 64 tokens (most prompts here) on it rather than >= 256.
FLASH = {"prefill_attention": "flash", "gemm_attention_min_tokens": 64}


@pytest.mark.parametrize("name, serving", [("qwen3-0.6b", {}), ("qwen3-0.6b", FLASH), ("tiny-qwen3-g5", {})],
                         ids=["qwen3-0.6b", "qwen3-0.6b-flash", "tiny-qwen3-g5"])
def test_qwen3_hf_golden_bf16(name, serving):
    loaded = load_with_hf(name, "h200", "default", max_batch=64, max_context=512, max_prefill_tokens=16384,
                          gpu_memory_utilization=0.25, **serving)
    sequences, lengths = _prompts(loaded.plan.model.vocab_size, 64, 256, 16, seed=0)
    _gate(_logprob_deltas(loaded, sequences, lengths), 0.06, 0.2,
          f"{name} {loaded.plan.serving.prefill_attention} bf16")


def test_qwen3_hf_golden_float32():
    loaded = load_with_hf("qwen3-0.6b", "h200", "default", dtype="float32", max_batch=16, max_context=512,
                          max_prefill_tokens=4096, gpu_memory_utilization=0.25)
    torch.backends.cuda.matmul.allow_tf32 = False
    sequences, lengths = _prompts(loaded.plan.model.vocab_size, 16, 256, 16, seed=1)
    _gate(_logprob_deltas(loaded, sequences, lengths), 1e-3, 1e-3, "qwen3-0.6b float32")


@pytest.mark.parametrize("name, serving", [("qwen3.5-0.8b", {}), ("qwen3.5-0.8b", FLASH), ("tiny-qwen3.5-g6", {})],
                         ids=["qwen3.5-0.8b", "qwen3.5-0.8b-flash", "tiny-qwen3.5-g6"])
def test_qwen3_5_hf_golden_bf16(name, serving):
    """The two 4097-token prompts prefill in chunks of 2048, 2048 and 1: long chunks after cached tokens
    (flash: the chunk's rows are the last of kv_len, over a gated, strided q)."""
    long_prompts = 0 if name.startswith("tiny") else 2  # tiny models stop at 512 positions
    loaded = load_with_hf(name, "h200", "default", max_batch=34, max_context=4200 if long_prompts else 512,
                          max_prefill_tokens=2048, gpu_memory_utilization=0.25, **serving)
    sequences, lengths = _prompts(loaded.plan.model.vocab_size, 32, 256, 8, seed=2, long_prompts=long_prompts)
    _gate(_logprob_deltas(loaded, sequences, lengths, chunk=2048), 0.06, 0.2,
          f"{name} {loaded.plan.serving.prefill_attention} bf16")


@pytest.mark.parametrize("name", ["qwen3-0.6b", "qwen3.5-0.8b"])
def test_batch_1_decode_hf_golden_bf16(name):
    """Decode steps of one request run the fused GEMV projections (capacity decode_gemv_batch 1), which the
    batched runs above never reach: three requests, each alone, 24 teacher-forced decode steps each."""
    loaded = load_with_hf(name, "h200", "default", max_batch=8, max_context=512, max_prefill_tokens=512,
                          gpu_memory_utilization=0.25)
    assert loaded.plan.capacity.decode_gemv_batch == 1
    sequences, lengths = _prompts(loaded.plan.model.vocab_size, 3, 128, 24, seed=3)
    deltas = np.concatenate([_logprob_deltas(loaded, [seq], [n]) for seq, n in zip(sequences, lengths)])
    _gate(deltas, 0.06, 0.2, f"{name} batch-1 decode (GEMV projections) bf16")
