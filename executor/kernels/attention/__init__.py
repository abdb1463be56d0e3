"""Full attention over the paged KV cache: the paged kernel (prefill chunks; decode fallback), the
split-KV merge, decode attention on CUDA cores and on tensor cores (with the fused q/k norm + RoPE
prologue), FlashAttention-2 prefill on tensor cores (``mma.sync``, and Hopper's warpgroup ``wgmma``) with
the online softmax they share, and the GEMM path's KV gather and causal softmax.
"""
