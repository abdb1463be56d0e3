"""Which kernel serves which step: the routing table and every threshold it uses.

This module is host-side (no torch, no numba) and is the one place the rules live: the launchers
import their thresholds from here, the step planner sizes decode tiles by them, and
``docs/kernels.md`` is this table rendered (``python3 -m executor.routing`` prints it; a test fails
when the two drift).

Shape rules (rows, batch, head_dim, dtype) are decided here. A launcher may still fall back from a
vector kernel to the scalar kernel of the same operation when a view is not 16-byte aligned: that
is a data-layout fallback with identical results, not a routing choice.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

#: Prefill chunks' paged attention packs this many query rows a tile: the rows of a tile share
#: every K/V load, so a long chunk's KV traffic falls by this factor.
PREFILL_ROWS_PER_TILE = 4

#: q/k norm + RoPE + KV write run as one fused launch for steps of at most this many rows (decode
#: steps and short chunks, where launches dominate: 7.5 us a Qwen3-8B layer at batch 1 on the
#: H200 against 12.3 us for three launches); longer steps take the separate kernels, which were
#: about 40 us a layer faster at 4,096 rows, and whose q/k norm + RoPE, row-wise, runs in the
#: layer's input piece of a prefill graph (only the KV write stays eager).
FUSED_ROPE_KV_MAX_ROWS = 128

#: bf16 q/k norm + RoPE calls of at least this many rows take the kernel specialized to its shape
#: (prefill chunks); shorter calls keep the vector kernel's wider blocks (the specialized kernel is
#: measured at long prefill only).
SPECIALIZED_ROPE_MIN_ROWS = 256

#: Tensor-core decode attention serves bf16 heads up to this head_dim: measured at 128; at 256 a
#: lane holds 64 output and 32 q registers and ptxas spills at sm_90, so those heads keep the
#: CUDA-core kernel.
TENSOR_CORE_DECODE_MAX_HEAD_DIM = 128

#: Decode attention aims at this many blocks an SM: about 180 registers a thread leave two
#: four-warp blocks resident an SM, so a decode step splits its rows into kv chunks until it has
#: this many blocks an SM (one wave), and calls of up to this many (row, kv head) pairs an SM run
#: the four-warp shape; larger calls run two-warp blocks in waves.
FEW_BLOCKS_PER_SM = 2

#: A split-KV merge launch of at most this many rows loads a row's first partials before it knows
#: the row is split: 4 rows' partials (1 MiB at Qwen3-8B) cost less than the dependent round they
#: save (0.7 us at batch 1), where batch 64's 16 MiB made the merge 3.8 us slower (H200).
MERGE_SPECULATE_MAX_ROWS = 4

#: Prefill steps of at least this many rows run the chunked gated delta rule
#: (linear_attention/chunked_delta_rule.py: a parallel pass over chunks of 64 tokens, then a scan of
#: the chunks carrying the state, both as matrix products on tensor cores), shorter ones the
#: recurrent kernel; None would send every prefill step to the recurrent kernel. At Qwen3.5-9B's heads
#: on the H200 the chunked kernel takes 86 us to the recurrent kernel's 95 us at 1 x 64 rows and 4.2-8.5x
#: less from 1,024 rows to 64 x 512 (bench/delta_rule.py, docs/benchmarks.md "Gated delta rule of one
#: layer"): one chunk of rows is where it starts to win. Qwen3.5-0.8B's HF golden passes on this route
#: (tests/executor/test_chunked_delta_rule_route.py).
CHUNKED_DELTA_RULE_MIN_ROWS: int | None = 64

#: The chunked delta rule's scan runs 32 state columns a block (GPU_NARROW_SHAPE: twice the blocks,
#: two an SM) instead of 64 (one 171 KiB block an SM) when the 64-column grid, (dv / 64) x Hv x
#: requests blocks, leaves at least this many SMs per block: there most SMs would idle, and the
#: narrow blocks' second copy of each chunk's staging costs less than the idle SMs. At Qwen3.5-9B's
#: heads on the H200 (bench/delta_rule.py --shapes default,64:32:8:16,64:64:8:16, 132 SMs) the narrow
#: scan takes 1,850 us to the wide scan's 2,186 at 1 x 16,384 rows (64 wide blocks), and the wide scan
#: 1,550 us to 1,848 at 2 x 8,192 (128 blocks) and 1,562 to 1,871 at 4 x 4,096 (256).
CHUNKED_DELTA_RULE_NARROW_SCAN_SMS_PER_BLOCK = 2


#: Qwen3.5's causal conv1d gives a thread this many token rows of a prefill chunk: a thread's rows share
#: the K - 1 inputs each row reads before it, so a longer tile re-reads less of x (3 rows in 16 at K 4),
#: and 16 rows still leave a 16,384-token step a million threads.
CONV1D_PREFILL_ROWS_PER_TILE = 16

#: Decode rows (a request's one row) whose rows or state are not whole aligned 16-byte chunks run the
#: general build at this many rows a block (CausalConv1d.decode's fallback; aligned ones run the decode
#: build, a thread per row and chunk of channels): a tile of decode rows is that many requests, whose
#: conv states the block stages one request after another, so one row a block puts every request's
#: state copy in flight at once. A batch-256 decode step's conv1d (Qwen3.5-9B, bench/profile_decode.py
#: --batch 256) took 95.6 us a layer on the H200 at 16 rows a tile (2.3 ms of the step's 20.6, for 12.6
#: MB of state and 8 MB of rows), 97.7 us on the H100 at one row a tile with a thread's own state
#: accesses, and 90.8 us there with the state staged by the block (bench/kernels.py conv1d_decode: 84.8
#: us, 13% of the copy bandwidth): a block's chain of dependent loads, not its bytes, sets the time. The
#: decode build takes 11.0 us for the same launch on the H100 (bench/kernels.py conv1d_decode, against
#: 115.1 for this fallback in the same run).
CONV1D_DECODE_ROWS_PER_TILE = 1

#: FlashAttention prefill runs on warpgroup tensor-core products (attention/flash_wgmma.py: the
#: tensor cores read each staged key and value once for four warps) on GPUs of this compute capability
#: major (wgmma is sm_90a's), for these head sizes (the P V product's N is the head size); other GPUs
#: and heads run mma.sync (attention/flash.py), whose per-warp ldmatrix reads of K and V bound it by
#: shared-memory bandwidth. On an H100 one layer at 16,384 tokens took 5,020.5 us against 8,186.3 at
#: Qwen3.5-9B's heads and 4,886.8 against 7,415.1 at Qwen3-8B's (bench/attention.py, docs/benchmarks.md
#: "Causal prefill attention of one layer").
#: The head sizes are the measured ones (the kernel also takes 32 and 64: 32 unswizzled, a third of
#: the swizzled speed, and 64 not run on a GPU).
WARPGROUP_FLASH_MAJOR = 9
WARPGROUP_FLASH_HEAD_DIMS = (128, 256)


def warpgroup_flash(compute_capability: str, head_dim: int) -> bool:
    """Whether FlashAttention prefill on a GPU of ``compute_capability`` ("9.0") and heads of
    ``head_dim`` runs the warpgroup kernel."""
    return int(compute_capability.split(".")[0]) == WARPGROUP_FLASH_MAJOR and head_dim in WARPGROUP_FLASH_HEAD_DIMS


@dataclass(frozen=True)
class Route:
    """One row of the table: at this step kind and operation, when ``condition`` holds, ``kernel``
    runs, for the reason ``why``."""

    step: str
    operation: str
    condition: str
    kernel: str
    why: str


ROUTES: tuple[Route, ...] = (
    Route("any", "embedding", "always", "rows/embedding.py Embedding", "one gather a step"),
    Route("decode", "projections + norms", "batch <= plan capacity.decode_gemv_batch",
          "gemv.py Gemv (RMSNorm prologue, SwiGLU / residual epilogues)",
          "a small batch is bound by reading the weights once; cuBLAS pays launches and a norm between"),
    Route("decode", "projections + norms", "batch > capacity.decode_gemv_batch; every prefill step",
          "torch GEMMs + rows/norm.py AddRmsNormInplace + rows/activation.py SiluMul",
          "the matmul rate pays off once rows share the weight reads"),
    Route("decode", "q/k norm + RoPE + KV write + attention",
          f"full rotary (Qwen3), bf16, head_dim <= {TENSOR_CORE_DECODE_MAX_HEAD_DIM}",
          "attention/decode_rope.py (decode_mma.py with rope/decode_prologue.py): one launch",
          "the prologue's loads overlap the first KV pages'"),
    Route("decode", "q/k norm + RoPE + KV write", f"otherwise, rows <= {FUSED_ROPE_KV_MAX_ROWS}",
          "rope/fused_kv_write.py QkNormRopeWriteKv (fused)", "one launch instead of three"),
    Route("decode", "attention", f"bf16, head_dim <= {TENSOR_CORE_DECODE_MAX_HEAD_DIM}",
          "attention/decode_mma.py (four-warp blocks up to FEW_BLOCKS_PER_SM pairs an SM, two-warp past)",
          "the group's query heads are an MMA tile's rows"),
    Route("decode", "attention", "otherwise (float32, head_dim 256)", "attention/decode.py (CUDA cores)",
          "lane groups per key, online softmax"),
    Route("decode", "attention merge", "a row split in kv chunks", "attention/merge.py SplitMerge",
          f"split-KV fills the SMs at small batch; speculative loads up to {MERGE_SPECULATE_MAX_ROWS} rows"),
    Route("prefill", "q/k norm + RoPE + KV write", f"rows <= {FUSED_ROPE_KV_MAX_ROWS}",
          "rope/fused_kv_write.py (fused)", "launch-bound"),
    Route("prefill", "q/k norm + RoPE", f"rows > {FUSED_ROPE_KV_MAX_ROWS}, bf16, rows >= {SPECIALIZED_ROPE_MIN_ROWS}",
          "rope/specialized.py in the layer's input piece (a prefill graph's, graphs.py), then rows/kv_cache.py "
          "WriteKv eagerly", "bandwidth-bound; shape compiled in; row-wise, so it replays with the projection"),
    Route("prefill", "q/k norm + RoPE", f"rows > {FUSED_ROPE_KV_MAX_ROWS}, otherwise",
          "rope/qk_norm_rope.py (vector, scalar for unaligned views) in the input piece, then WriteKv eagerly",
          "general shapes"),
    Route("prefill", "attention", "chunk of 2 .. gemm_attention_min_tokens - 1 rows",
          f"attention/paged.py PagedAttention ({PREFILL_ROWS_PER_TILE} rows a tile)",
          "short chunks of any mix in one launch"),
    Route("prefill", "attention", "decode rows (one-row chunks) beside prefill chunks",
          "attention/decode.py DecodeAttention (decode_mma.py for bf16 heads <= 128), no KV split, the "
          "block shape for max_batch rows",
          "248 decode rows at 1,100 tokens beside 8 x 1,024 prefill, Qwen3-8B on the H200: 7.5 ms a layer "
          "in the paged kernel (a 4-row tile a row), 0.33 ms in the decode kernel"),
    Route("prefill", "attention", "chunk >= gemm_attention_min_tokens, plan prefill_attention flash (bf16, "
          "head_dim % 32 == 0)", "attention/gather.py PackedGatherKv + attention/flash.py FlashAttention "
          f"(attention/flash_wgmma.py's warpgroup kernel on compute capability {WARPGROUP_FLASH_MAJOR}.x, head_dim "
          f"in {WARPGROUP_FLASH_HEAD_DIMS}): one "
          "pair of launches over the step's long chunks (as many as their keys fit the gather scratch)",
          "tensor cores, no score buffer; the chunks' blocks in one grid (Qwen3-8B serving 512 x 1,024 on the "
          "H200: 1,035 ms in 2,304 launches against 1,514 ms in 18,432, a launch a chunk)"),
    Route("prefill", "attention", "chunk >= gemm_attention_min_tokens, prefill_attention gemm (non-bf16 runs: "
          "float32 in the simulator, float16)", "GatherKv + torch GEMMs + attention/causal_softmax.py",
          "the path for dtypes the flash kernel does not take"),
    Route("prefill", "conv1d (Qwen3.5)", "the chunks' rows",
          "linear_attention/conv1d.py CausalConv1d, CONV1D_PREFILL_ROWS_PER_TILE rows a thread",
          "a thread's rows share the inputs before them"),
    Route("any", "conv1d (Qwen3.5)", "decode rows (a decode step's, the leading rows of a prefill step), "
          "rows and state of whole aligned 16-byte chunks",
          "linear_attention/conv1d.py CausalConv1d.decode (a thread per row and chunk of channels)",
          "every access a 16-byte vector, one dependent load (the state after its slot), no barrier"),
    Route("any", "conv1d (Qwen3.5)", "decode rows otherwise",
          "linear_attention/conv1d.py CausalConv1d, CONV1D_DECODE_ROWS_PER_TILE rows a thread",
          "a request a block: its state's copy is not queued behind other requests'"),
    Route("prefill", "gates, gated norm (Qwen3.5)", "always",
          "delta_rule.py GdnGates, rows/gated_norm.py", "one launch each"),
    Route("prefill", "gated delta rule (Qwen3.5)", "the decode rows (one-row chunks) a prefill step starts with "
          "(the scheduler's order)", "linear_attention/delta_rule_decode.py GatedDeltaRuleDecode",
          "248 decode rows beside 8 x 1,024 prefill, Qwen3.5-9B on the H200: the chunked kernel over all of "
          "them took 155 ms of the step's 335, against 49 ms without the decode rows"),
    Route("prefill", "gated delta rule (Qwen3.5)", "the rest: rows >= CHUNKED_DELTA_RULE_MIN_ROWS (None: never)",
          "linear_attention/chunked_delta_rule.py ChunkedGatedDeltaRule (bf16: a parallel prepare pass over "
          "chunks into the plan's delta_* scratch, then the scan, on tensor cores, at 32 state columns a "
          "block where 64 leave CHUNKED_DELTA_RULE_NARROW_SCAN_SMS_PER_BLOCK SMs a block; "
          "float32 loops otherwise)",
          "a chunk's rows as matrix products; the state carried once a chunk"),
    Route("prefill", "gated delta rule (Qwen3.5)", "otherwise", "linear_attention/delta_rule.py GatedDeltaRule",
          "recurrent over a chunk's tokens"),
    Route("decode", "gated delta rule (Qwen3.5)", "state rows 16-byte aligned",
          "linear_attention/delta_rule_decode.py", "bound by moving the state once"),
    Route("any", "output gate (Qwen3.5)", "always", "rows/output_gate.py SigmoidMulInplace", "in place"),
    Route("any", "sampling", "always", "sampling/sampler.py Sample (greedy, temperature, top-k, top-p)",
          "one launch for the step's rows"),
)


def render_markdown() -> str:
    """``docs/kernels.md``: the thresholds and the table, for readers."""
    names = ("PREFILL_ROWS_PER_TILE", "FUSED_ROPE_KV_MAX_ROWS", "SPECIALIZED_ROPE_MIN_ROWS",
             "TENSOR_CORE_DECODE_MAX_HEAD_DIM", "FEW_BLOCKS_PER_SM", "MERGE_SPECULATE_MAX_ROWS",
             "CHUNKED_DELTA_RULE_MIN_ROWS", "CONV1D_PREFILL_ROWS_PER_TILE", "CONV1D_DECODE_ROWS_PER_TILE")
    module = sys.modules[__name__]
    lines = ["# Kernels: which one serves which step", "",
             "Rendered from `executor/routing.py` (`python3 -m executor.routing > docs/kernels.md`); "
             "kernel paths are under `executor/kernels/`.", "",
             "## Thresholds", "", "| name | value |", "| --- | ---: |"]
    lines += [f"| `{name}` | {getattr(module, name)} |" for name in names]
    lines += ["", "## Routes", "", "| step | operation | when | kernel | why |", "| --- | --- | --- | --- | --- |"]
    lines += [f"| {r.step} | {r.operation} | {r.condition} | {r.kernel} | {r.why} |" for r in ROUTES]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.stdout.write(render_markdown())
