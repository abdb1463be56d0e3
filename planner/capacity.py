"""Capacities: the largest step and batch shapes the planned buffers can hold.

Every capacity is an i32 quantity because kernels index with i32; each is
derived once here and carried in the plan (invariant 2, docs/design.md).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner import checked
from planner.checked import I32
from planner.config import PrefillAttention
from planner.kernel_limits import (DELTA_RULE_CHUNK, GEMV_CHUNK_BYTES, GEMV_SCRATCH_BYTES, GEMV_SHARED_BYTES,
                                   MAX_DECODE_KV_SPLITS, MAX_PREFILL_SCORE_ELEMENTS, MIN_KV_CHUNK_TOKENS)

class Capacity(BaseModel):
    """Planned limits of one step (tokens, pages, tiles) and of the KV pool."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    max_batch: int = Field(description="B: requests in one step")
    max_context: int = Field(description="C: tokens of one request, prompt plus output")
    page_size: int = Field(description="S: tokens per KV page")
    max_prefill_tokens: int = Field(description="prefill tokens per step (the chunk)")
    max_tokens_per_step: int = Field(description="T = max(max_prefill_tokens + B - 1, B), or serving max_step_tokens "
                                     "when set: rows of a step, decode rows included")
    prefill_tokens_beside_decode: int = Field(0, description="prefill tokens a step takes while it carries decode "
                                              "rows: serving max_prefill_tokens_beside_decode, or "
                                              "max_prefill_tokens when unset (0: max_prefill_tokens)")
    pages_per_request: int = Field(description="ceil(C / S): logical pages one request can list")
    logical_pages: int = Field(description="P = B x ceil(C / S): page-table entries of a step (shared pages count per request)")
    tiles: int = Field(description="N = max(T x gqa_group, B x decode_kv_splits): attention work tiles of a step")
    decode_kv_splits: int = Field(1, description="most kv chunks a decode row's attention is split into: "
                                  "min(32, ceil(C / 64)), the depth of the decode pool's split scratch")
    prefill_attention: PrefillAttention = Field("gemm", description="backend of long prefill chunks' attention: "
                                                "serving prefill_attention, with auto decided (flash where the "
                                                "kernel takes the model and dtypes)")
    prefill_gather_tokens: int = Field(0, description="keys (and values) that the prefill pool's attn_keys / "
                                       "attn_values [Hkv, this, D] scratch holds for long-chunk attention (serving "
                                       "gemm_attention_min_tokens): gemm, one request's, C; flash, a step's long "
                                       "chunks' packed together, max(C, max_prefill_tokens) (all of a step's fresh "
                                       "prompts, or one request's whole context); 0 when no chunk is that long or the "
                                       "model has no full-attention layer")
    prefill_score_elements: int = Field(0, description="scores of one GEMM prefill-attention tile (0: no GEMM "
                                        "attention, e.g. prefill_attention flash): "
                                        "min(Hq x T x C, max(2^26, Hq x C))")
    delta_rule_chunk: int = Field(0, description="tokens of the chunked gated delta rule's chunk whose transform "
                                  "and Gram rows the prefill pool's delta_transform / delta_gram scratch hold per "
                                  "row and value head: 64 (Qwen3.5 with bf16 activations), else 0 (no scratch)")
    decode_gemv_batch: int = Field(0, description="decode steps of at most this many requests run the fused GEMV "
                                   "projections: serving decode_gemv_max_batch, capped by max_batch and by "
                                   "B x hidden x 4 + 512 bytes of shared memory <= 48 KiB; 0 when some projection "
                                   "input is not whole 16-byte chunks")
    prefill_graph_rows: tuple[int, ...] = Field((), description="row buckets of the prefill graphs: serving "
                                                "prefill_graph_token_sizes up to T; empty with tensor parallelism")
    recurrent_slots: int = Field(0, description="recurrent-state slots: B x states_per_slot (Qwen3.5)")
    prefix_state_slots: int = Field(0, description="recurrent-state snapshots of the prefix cache, after the "
                                    "recurrent slots in the recurrent_state pool: serving prefix_state_slots with "
                                    "linear-attention layers, else 0")
    kv_pages: int = Field(0, description="KV pages allocated, page 0 (padding) included")
    kv_tokens: int = Field(0, description="tokens the usable KV pages hold: (kv_pages - 1) x S")
    kv_bytes_per_token: int = Field(0, description="KV bytes one token takes over this rank's full-attention "
                                    "layers (K and V)")
    max_concurrency: float = Field(0.0, description="requests of max_context held at once: usable KV pages / "
                                   "pages_per_request (kv_tokens / C in whole pages), capped by max_batch and by the "
                                   "requests the recurrent-state slots hold; a plan fits only when this is >= 1")
    concurrency_limit: Literal["kv_cache", "max_batch", "recurrent_slots"] = Field(
        "kv_cache", description="what caps max_concurrency: the KV pool, or max_batch / the recurrent slots "
        "(then KV memory is left over: kv_pages_beyond_batch)")
    kv_pages_beyond_batch: int = Field(0, description="usable KV pages that the requests max_batch and the "
                                       "recurrent slots admit never fill, at max_context each (only the prefix cache "
                                       "can use them); 0 when the KV pool is the limit")
    max_batch_at_context: int = Field(0, description="largest max_batch at which that many requests of max_context "
                                      "fit at once, re-planned at that batch (step buffers, slots and graphs grow "
                                      "with it)")
    max_context_at_batch: int = Field(0, description="largest max_context (up to the model's limit) at which "
                                      "max_batch requests of it fit at once, re-planned at that context; 0: none")


def build_capacity(
    *, max_batch: int, max_context: int, page_size: int, max_prefill_tokens: int, gqa_group: int,
    recurrent_slots_per_request: int, prefix_state_slots: int = 0, num_q_heads: int = 0,
    gemm_attention_min_tokens: int = 1, prefill_attention: PrefillAttention = "gemm", decode_gemv_batch: int = 0,
    delta_rule_scratch: bool = False,
    prefill_tokens_beside_decode: int | None = None, prefill_graph_token_sizes: tuple[int, ...] = (),
    max_step_tokens: int | None = None,
) -> Capacity:
    """Capacities before the KV pool is sized (kv_pages and kv_tokens stay 0). ``num_q_heads`` 0
    (no full-attention layer) or ``gemm_attention_min_tokens`` above ``max_prefill_tokens``: no
    long-chunk prefill attention, so no gather scratch and no score tile. ``prefill_attention``
    "flash" gathers keys too, but its kernel keeps the scores on chip: no score tile.
    ``delta_rule_scratch``: the model's linear-attention prefill runs the two-pass chunked delta rule
    (bf16 activations), whose per-row scratch the prefill pool holds. ``prefill_graph_token_sizes``: the
    prefill graphs' row buckets asked for (those above the step's rows are dropped). ``max_step_tokens``:
    serving's cap on a step's rows, decode rows included (None: a whole chunk beside max_batch - 1 decode
    rows, or max_batch decode rows). ``prefix_state_slots``: the prefix cache's recurrent-state snapshots,
    planned only where ``recurrent_slots_per_request`` is (a model with linear-attention layers)."""
    tokens = max(checked.add("max_tokens_per_step", max_prefill_tokens, max_batch - 1, width=I32), max_batch)
    if max_step_tokens is not None:
        tokens = min(tokens, max_step_tokens)
    pages_per_request = checked.ceil_div("pages_per_request", max_context, page_size, width=I32)
    kv_splits = min(MAX_DECODE_KV_SPLITS, checked.ceil_div("decode_kv_splits", max_context, MIN_KV_CHUNK_TOKENS))
    long_chunks = bool(num_q_heads) and gemm_attention_min_tokens <= max_prefill_tokens
    score_elements = 0
    if long_chunks and prefill_attention == "gemm":
        one_row = checked.mul("prefill scores of one row", num_q_heads, max_context, width=I32)
        whole_step = checked.mul("prefill scores of a step", one_row, tokens, width=checked.I64)
        score_elements = min(whole_step, max(MAX_PREFILL_SCORE_ELEMENTS, one_row))
    # flash packs a step's long chunks in one launch (executor/kernels/attention/packed.py): fresh prompts'
    # keys add up to at most max_prefill_tokens; gemm gathers one request at a time.
    gather_tokens = 0
    if long_chunks:
        gather_tokens = max(max_context, max_prefill_tokens) if prefill_attention == "flash" else max_context
    return Capacity(
        max_batch=max_batch,
        max_context=max_context,
        page_size=page_size,
        max_prefill_tokens=max_prefill_tokens,
        max_tokens_per_step=tokens,
        prefill_tokens_beside_decode=min(prefill_tokens_beside_decode or max_prefill_tokens, max_prefill_tokens),
        pages_per_request=pages_per_request,
        logical_pages=checked.mul("logical_pages", max_batch, pages_per_request, width=I32),
        tiles=max(checked.mul("tiles", tokens, gqa_group, width=I32),
                  checked.mul("decode tiles", max_batch, kv_splits, width=I32)),
        decode_kv_splits=kv_splits,
        prefill_attention=prefill_attention,
        prefill_gather_tokens=gather_tokens,
        prefill_score_elements=score_elements,
        decode_gemv_batch=decode_gemv_batch,
        prefill_graph_rows=tuple(rows for rows in prefill_graph_token_sizes if rows <= tokens),
        delta_rule_chunk=DELTA_RULE_CHUNK if delta_rule_scratch else 0,
        recurrent_slots=checked.mul("recurrent_slots", max_batch, recurrent_slots_per_request, width=I32),
        prefix_state_slots=prefix_state_slots if recurrent_slots_per_request else 0,
    )


def gemv_batch_limit(requested: int, max_batch: int, hidden_size: int, in_features: tuple[int, ...],
                     itemsize_bytes: int) -> int:
    """The capacity's decode_gemv_batch: ``requested`` (serving decode_gemv_max_batch) capped by
    ``max_batch`` and by the rows of ``hidden_size`` float32 a block's shared memory stages; 0 when some
    projection's ``in_features`` of ``itemsize_bytes`` elements is not a whole number of 16-byte chunks."""
    if any(checked.mul("GEMV row bytes", k, itemsize_bytes) % GEMV_CHUNK_BYTES for k in in_features):
        return 0
    staged_rows = (GEMV_SHARED_BYTES - GEMV_SCRATCH_BYTES) // checked.mul("staged row bytes", hidden_size, 4)
    return min(requested, max_batch, staged_rows)


def with_kv_pages(capacity: Capacity, kv_pages: int) -> Capacity:
    """The capacity with the KV pool sized: ``kv_pages`` pages, page 0 reserved for padding."""
    checked.fit("kv_pages", kv_pages, I32)
    usable = max(kv_pages - 1, 0)
    return capacity.model_copy(
        update={"kv_pages": kv_pages, "kv_tokens": checked.mul("kv_tokens", usable, capacity.page_size, width=checked.I64)}
    )
