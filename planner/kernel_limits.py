"""The kernels' limits that the planner sizes buffers by and refuses configs with.

The planner owns these numbers and the kernels import them, so a plan and the kernel that runs it
cannot disagree on a scratch depth, a tile size or a supported shape.
"""

from __future__ import annotations

#: Split-KV decode: a decode row's attention may be cut into kv chunks of at least
#: this many tokens, computed by separate blocks and merged (long contexts at small
#: batch otherwise leave most SMs idle: B x Hkv blocks)...
MIN_KV_CHUNK_TOKENS = 64
#: ... and into at most this many chunks (the depth of the decode pool's split scratch).
MAX_DECODE_KV_SPLITS = 32
#: GEMM prefill attention: float32 scores (and their probabilities in the activation dtype) of one
#: tile of query rows x keys x q heads; a tile holds at most this many, or one row's whole context
#: (Hq x C) when that is larger. 2^26 elements = 384 MiB with bf16 probabilities.
MAX_PREFILL_SCORE_ELEMENTS = 1 << 26
#: Fused decode GEMVs (executor/kernels/gemv.py): a block stages its B normalized rows as float32 in shared
#: memory, after which its reduction scratch (a float32 per thread of a 128-thread block) must still fit the
#: 48 KiB a block gets without opting in to more; every projection input a whole number of 16-byte chunks.
GEMV_SHARED_BYTES = 48 * 1024
GEMV_SCRATCH_BYTES = 4 * 128
GEMV_CHUNK_BYTES = 16

#: prefill_attention "flash": the kernel loads Q K^T operands 32 head dimensions at a time (two MMA k-steps a
#: fragment load; tests/executor/test_flash_prefill.py holds this to executor/kernels/attention/flash.py)...
FLASH_HEAD_DIM_MULTIPLE = 32
#: ... and reads q, k, v and writes its output as bf16 only.
FLASH_DTYPE = "bfloat16"

#: The chunked gated delta rule on tensor cores (executor/kernels/linear_attention/chunked_delta_rule.py) runs in
#: two passes over a prefill step: one block per chunk of this many tokens computes the chunk's transform
#: (I + A)^-1 and its causal decayed q k^T (the Gram rows) in parallel, and one block per (request, head, dv
#: tile) then walks the chunks in order with the state on chip. The prefill pool holds the first pass's
#: output per token row and value head: the chunk's row of each (bf16, this many columns)...
DELTA_RULE_CHUNK = 64
#: ... and this many float32 factors of the row (beta, the decay-weighted norms, the chunk's total decay).
DELTA_RULE_ROW_SCALARS = 8
#: ... for bf16 activations only: other storage runs the single-pass float32 build, which needs no scratch.
DELTA_RULE_SCRATCH_DTYPE = "bfloat16"
