"""serving prefill_attention flash: long prefill chunks run one FlashAttention launch each, over the
plan's gather scratch only, and give the logits of the paged kernel (and of HF) in bf16.

The FlashAttention kernel costs seconds a block in the simulator (a block per q head), so the model is
tiny-qwen3 cut to one layer of two q heads, each over its own kv head (two kv heads: the gather scratch's
head-major layout meets the kernel's; GQA groups are tests/kernels/test_flash_attention.py's), with the
smallest head_dim the kernel takes, and the test runs one launch."""

from __future__ import annotations

import pytest
import torch

from executor.kernels.attention.flash import FlashAttention, single_request
from executor.models.flash_prefill_attention import FlashPrefillAttention
from executor.step import RequestChunk, plan_step
from planner.kernel_limits import FLASH_HEAD_DIM_MULTIPLE
from planner.config import ModelConfig
from planner.loader import load_model
from planner.plan import MemoryPlan
from tests.executor.harness import hf_logits, load_tiny, random_sequences

#: bf16 logits against the paged kernel's: the kernel rounds its probabilities to bf16 (measured 2.9e-3;
#: passing kv_len - 1, every row one position early, gives 0.12)...
FLASH_VS_PAGED = 1e-2
#: ... and either against HF in bf16, whose own roundings differ (measured up to 3.2e-3).
VS_HF = 1.5e-2


def _flash_model() -> ModelConfig:
    """tiny-qwen3 with one layer of 2 q heads over 2 kv heads, of the smallest head_dim flash takes."""
    tiny = load_model("tiny-qwen3").model_dump()
    return ModelConfig.model_validate({**tiny, "name": "tiny-qwen3-flash", "num_layers": 1, "num_attention_heads": 2,
                                       "num_key_value_heads": 2, "head_dim": FLASH_HEAD_DIM_MULTIPLE})


def _paged_only(plan: MemoryPlan) -> MemoryPlan:
    """``plan`` with no chunk long enough for the long-chunk backend: plan_step gives every row a
    paged-attention tile. The same arena and model run it."""
    serving = plan.serving.model_copy(update={"gemm_attention_min_tokens": plan.capacity.max_prefill_tokens + 1})
    return plan.model_copy(update={"serving": serving})


def _relative_error(mine: torch.Tensor, theirs: torch.Tensor) -> float:
    return float((mine.float() - theirs.float()).abs().max() / theirs.float().abs().max())


def test_the_planners_head_dim_multiple_is_the_kernels():
    """planner FLASH_HEAD_DIM_MULTIPLE (the refusal's limit) holds to the launcher's: half of it is refused
    (the simulator test below runs the multiple itself)."""
    half = FLASH_HEAD_DIM_MULTIPLE // 2
    q = torch.zeros(1, 2, half, dtype=torch.int16)
    k = torch.zeros(1, 4, half, dtype=torch.int16)
    with pytest.raises(ValueError, match=f"head_dim {half}"):
        FlashAttention()(q, k, k.clone(), q.clone(), *single_request(1, 1), 0, 1, 1, 1)


def test_flash_prefill_matches_the_paged_kernel_and_hf():
    """A 3-token first chunk (paged: below gemm_attention_min_tokens 4), then one step of the same request's
    next 5 tokens (flash: kv_len 8 over two pages, rows at positions 3..7) beside another request's 2-token
    chunk (paged). The flash step's logits equal those of the same step with every row on the paged kernel,
    the other request's bit for bit, and both are within bf16 reach of HF."""
    loaded = load_tiny(_flash_model(), dtype="bfloat16", prefill_attention="flash")
    plan, model = loaded.plan, loaded.model
    assert plan.serving.gemm_attention_min_tokens == 4
    assert plan.capacity.prefill_gather_tokens == max(plan.capacity.max_context, plan.capacity.max_prefill_tokens)
    assert plan.capacity.prefill_score_elements == 0
    (layer,) = model.layers
    assert isinstance(layer.mixer.long_prefill_attention, FlashPrefillAttention)
    long_ids, short_ids = random_sequences(plan.model.vocab_size, [8, 2], seed=5)
    pages = plan.capacity.pages_per_request
    long_pages, short_pages = list(range(1, 1 + pages)), list(range(1 + pages, 1 + 2 * pages))
    model.step(plan_step(plan, [RequestChunk(long_ids[:3], 0, long_pages)]))
    second = [RequestChunk(long_ids[3:], 3, long_pages), RequestChunk(short_ids, 0, short_pages)]

    meta = plan_step(plan, second)
    (routed,) = meta.long_prefill_requests
    assert (routed.request, routed.num_rows, routed.kv_len, routed.rows_per_tile) == (0, 5, 8, 5)  # one launch
    assert set(meta.request_indices.tolist()) == {1}
    model.step(meta)
    flash = model.logits(2).clone()
    # The step again with every row on the paged kernel: it rewrites the same keys and values.
    reference = plan_step(_paged_only(plan), second)
    assert not reference.long_prefill_requests
    model.step(reference)
    paged = model.logits(2).clone()

    assert _relative_error(flash[0], paged[0]) <= FLASH_VS_PAGED
    assert torch.equal(flash[1], paged[1])  # the flash launch wrote only its request's rows
    for logits, ids in ((flash[0], long_ids), (paged[0], long_ids), (paged[1], short_ids)):
        assert _relative_error(logits, hf_logits(loaded.hf, ids)[-1]) <= VS_HF
