"""The sampling pool: last-row gather, logits and sampled ids for B requests."""

from __future__ import annotations

from planner.geometry import Geometry
from planner.layout import BufferRequest, Pool, pack_sequential


def build_sampling(geometry: Geometry, max_batch: int, dtype: str) -> Pool:
    """Buffers from the final hidden rows to the sampled token ids.

    logits_indices [B] int32   step row whose logits each request samples from
    last_hidden    [B, H]      those rows, gathered
    logits_raw     [B, V]      lm_head output in the activation dtype
                   tp > 1: [tp, B, Vs], every rank's lm_head output (Vs = ceil(V / tp) rows of its
                   vocab shard), rank-major: a step of n requests uses the first tp x n x Vs elements
                   as [tp, n, Vs], rank r writing [r] and an all-gather filling the others
    logits         [B, V] f32  the same logits widened for sampling
                   tp > 1: [B, tp x Vs], the gathered shards in vocabulary order; the sampler reads
                   columns [0, V), the padded tail is never sampled
    temperature    [B] f32     per request; <= 0 is greedy
    top_k          [B] int32   per request; <= 0 is no restriction
    top_p          [B] f32     per request; >= 1 is no restriction (the nucleus needs no scratch: the
                               sampler's radix select keeps its mass bins in shared memory)
    seeds          [B] int64   per request RNG key
    sample_steps   [B] int32   index of the token each request samples (the RNG counter)
    sampled_ids    [B] int32   the step's output tokens (the one host read-back)
    """
    g = geometry
    tp = g.tensor_parallel_size
    raw_shape = (max_batch, g.vocab_size) if tp == 1 else (tp, max_batch, g.vocab_size)
    logits_shape = (max_batch, g.vocab_size) if tp == 1 else (max_batch, g.padded_vocab_size)
    return pack_sequential(
        "sampling",
        [
            BufferRequest("logits_indices", "int32", (max_batch,)),
            BufferRequest("last_hidden", dtype, (max_batch, g.hidden_size)),
            BufferRequest("logits_raw", dtype, raw_shape),
            BufferRequest("logits", "float32", logits_shape),
            BufferRequest("temperature", "float32", (max_batch,)),
            BufferRequest("top_k", "int32", (max_batch,)),
            BufferRequest("top_p", "float32", (max_batch,)),
            BufferRequest("seeds", "int64", (max_batch,)),
            BufferRequest("sample_steps", "int32", (max_batch,)),
            BufferRequest("sampled_ids", "int32", (max_batch,)),
        ],
    )
