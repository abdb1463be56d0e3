"""q/k RMSNorm + NeoX RoPE: the general and vector kernels (qk_norm_rope), the bf16 prefill kernel
specialized to its shape (specialized, with its unit and chunk layouts), the fused form that also
writes the paged KV cache (fused_kv_write), and the decode prologue of tensor-core attention.
"""
