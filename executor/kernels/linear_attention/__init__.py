"""Qwen3.5's Gated DeltaNet: the causal depthwise conv1d with its per-slot state, the gates, and the
gated delta rule for prefill chunks (recurrent, and chunked on tensor cores) and decode steps.
"""
