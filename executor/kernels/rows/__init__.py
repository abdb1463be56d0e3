"""Row kernels, bound by memory bandwidth: RMSNorm (plain and fused with the residual add), the
gated RMSNorm, SwiGLU, Qwen3.5's output gate, the embedding gather, the paged KV write and strided
16-byte copies.
"""
