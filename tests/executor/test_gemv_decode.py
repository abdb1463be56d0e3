"""Decode steps on the fused GEMV projections (capacity decode_gemv_batch) give the cuBLAS path's
logits, tokens and KV cache: tiny float32 models in the simulator. (The shipped sim serving config
turns the GEMVs off for the other model tests; the GPU tests run them on real models against HF.)"""

from __future__ import annotations

import torch

from tests.executor.harness import decode_state, greedy_decode, load_tiny, prefilled_requests


def test_gemv_decode_equals_gemm_decode():
    """Qwen3.5's blocks cover every GEMV use (qkv, in_proj, gate_up and the final norm + lm_head
    normalize; o_proj, out_proj, down add; the zero-centred norm); test_gemv.py runs Qwen3's norm
    rounding. One decode step: the simulator multiplies every weight element in Python."""
    name = "tiny-qwen3.5"
    runs = {}
    for gemv_batch in (1, 0):
        loaded = load_tiny(name, decode_gemv_max_batch=gemv_batch)  # the same seed: the same weights
        assert loaded.plan.capacity.decode_gemv_batch == gemv_batch
        chunks = prefilled_requests(loaded, [6], seed=5)
        logits, tokens = greedy_decode(loaded, chunks, steps=1)
        runs[gemv_batch] = (logits, tokens, decode_state(loaded))
    (gemv_logits, gemv_tokens, gemv_state), (gemm_logits, gemm_tokens, gemm_state) = runs[1], runs[0]
    assert gemv_tokens == gemm_tokens
    scale = float(gemm_logits.abs().max())
    assert float((gemv_logits - gemm_logits).abs().max()) <= 1e-5 * scale
    for key in gemm_state:  # the decode steps' KV (and recurrent state) writes; NaN poison where unwritten
        assert torch.allclose(gemv_state[key], gemm_state[key], rtol=1e-5, atol=1e-6, equal_nan=True), key
