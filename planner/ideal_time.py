"""The ideal time of a serving workload on a plan: the work its prefill and decode cannot avoid, at the device's
measured matmul rate and copy bandwidth (pure Python, no torch; the rates come from the benchmark that runs it).

A workload is a list of (prompt tokens, output tokens) requests, optionally with a prefix of ``shared_prefix``
tokens that every prompt starts with and that is computed once (prefix caching). Every size comes from the plan:
the weight shapes of its ``weights`` pool, its geometry, ``capacity.kv_bytes_per_token``, the per-slot bytes of
its ``recurrent_state`` pool and ``capacity.max_batch``.

Prefill (compute bound): each prompt token that is computed costs 2 FLOPs per weight of every 2-D projection
(the embedding table is a lookup, and lm_head runs only for the last prompt token of a request, the only row
sampled); each full-attention layer adds Q K^T and P V over the causal context, 4 x Hq x D FLOPs per
(query, key) pair; each linear-attention layer adds the delta rule's three state products (S^T k, k delta^T,
S^T q), 6 x Hv x dk x dv FLOPs a token. Norms, the conv1d, activations and softmax are left out.

Decode (memory bound): a request's first output token comes from its prefill, so it decodes ``output - 1`` rows;
row j of a request of prompt n reads the KV of its n + j + 1 tokens (its own included) and, on Qwen3.5, reads
and writes its recurrent slot. Requests decode in admission order, at most ``max_batch`` at once; a step runs a
row of every request still decoding, and a request finished in a step makes room for the next one in the
following step. A step moves every weight once (all weights but the embedding table, which is read as lm_head
only when tied) plus its rows' KV and state bytes, and computes its rows' FLOPs as prefill does per token.

Ideal seconds = prefill FLOPs / matmul rate + the sum over decode steps of max(step bytes / copy bandwidth,
step FLOPs / matmul rate): a step is bound by the larger of the two. The parts add up as if prefill and decode
ran in steps of their own; an engine that runs decode rows inside prefill steps can hide some decode traffic
under prefill compute, so the prefill part alone is the bound no schedule beats.

``step_ideal_s`` prices one step an engine ran (``StepWork``: its prefill chunks and decode rows) the same way,
so a serving run's steps can be set against their own ideal: the steps' ideals summed less the workload's is
what the schedule added (more decode steps, weights read again), and each step's measured time over its ideal
is what running it lost.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from planner.plan import MemoryPlan

EMBEDDING = "model.embed_tokens.weight"
LM_HEAD = "lm_head.weight"
#: FLOPs per multiply-add.
FLOPS_PER_MAC = 2
#: Q K^T and P V: two multiply-adds per (query, key) pair and head dimension.
ATTENTION_PRODUCTS = 2
#: The delta rule's state products a token: S^T k, k delta^T and S^T q, each dk x dv multiply-adds a head.
DELTA_RULE_PRODUCTS = 3


@dataclass(frozen=True)
class ModelCosts:
    """Per-token costs of one plan's model (one tensor-parallel rank)."""

    projection_weights: int  # weights of the 2-D projections of every layer (lm_head and embedding excluded)
    lm_head_weights: int
    decode_weight_bytes: int  # weight bytes a decode step reads
    kv_bytes_per_token: int
    state_bytes_per_row: int  # recurrent slot bytes a decode row reads and writes (read + write)
    attention_flops_per_pair: int  # FLOPs per (query, key) pair over every full-attention layer
    linear_flops_per_token: int  # delta-rule state FLOPs a token over every linear-attention layer
    max_batch: int

    @classmethod
    def of(cls, plan: MemoryPlan) -> ModelCosts:
        weights = plan.pool("weights")
        names = {buffer.name for buffer in weights.buffers}
        head = weights.buffer(LM_HEAD if LM_HEAD in names else EMBEDDING)
        projections = sum(math.prod(b.shape) for b in weights.buffers
                          if len(b.shape) == 2 and b.name not in (EMBEDDING, LM_HEAD))
        read = sum(b.bytes for b in weights.buffers if b.name != EMBEDDING or head.name == EMBEDDING)
        g = plan.geometry
        state = 0
        if g.num_linear_layers:
            pool = plan.pool("recurrent_state")
            state = 2 * sum(pool.buffer(name).bytes // pool.buffer(name).shape[1]
                            for name in ("ssm_state", "conv_state"))  # [linear layers, slots, ...]
        attention = FLOPS_PER_MAC * ATTENTION_PRODUCTS * g.num_q_heads * g.head_dim * g.num_full_layers
        linear = (FLOPS_PER_MAC * DELTA_RULE_PRODUCTS * g.linear_num_value_heads * g.linear_key_head_dim
                  * g.linear_value_head_dim * g.num_linear_layers)
        return cls(projections, math.prod(head.shape), read, plan.capacity.kv_bytes_per_token, state, attention,
                   linear, plan.capacity.max_batch)

    def token_flops(self, tokens: int, pairs: int) -> int:
        """FLOPs of ``tokens`` computed tokens (projections and the delta rule) whose queries see ``pairs``
        (query, key) pairs in all; lm_head not included."""
        return tokens * (FLOPS_PER_MAC * self.projection_weights + self.linear_flops_per_token) + \
            pairs * self.attention_flops_per_pair

    def decode_step(self, rows: int, context: int) -> DecodeStep:
        """A decode step of ``rows`` rows that read ``context`` KV tokens in all (each row's own included): every
        weight once, the rows' KV and recurrent-state bytes, and the rows' FLOPs with lm_head."""
        step_bytes = self.decode_weight_bytes + context * self.kv_bytes_per_token + rows * self.state_bytes_per_row
        return DecodeStep(rows, step_bytes, self.token_flops(rows, context) + rows * self.head_flops)

    @property
    def head_flops(self) -> int:
        """lm_head's FLOPs for one row."""
        return FLOPS_PER_MAC * self.lm_head_weights


@dataclass(frozen=True)
class DecodeStep:
    rows: int
    bytes: int
    flops: int

    def seconds(self, matmul_flops_per_s: float, copy_bytes_per_s: float) -> float:
        """The larger of its bytes' time and its FLOPs' time."""
        return max(self.bytes / copy_bytes_per_s, self.flops / matmul_flops_per_s)


@dataclass(frozen=True)
class StepWork:
    """The work of one step an engine ran: its prefill chunks' tokens, their causal (query, key) pairs and how
    many of them end a prompt (their last row runs lm_head), and its decode rows with the KV tokens they read
    (each row's own included)."""

    prefill_tokens: int = 0
    prefill_pairs: int = 0
    prefill_sampled: int = 0
    decode_rows: int = 0
    decode_context: int = 0


def step_ideal_s(costs: ModelCosts, work: StepWork, matmul_flops_per_s: float, copy_bytes_per_s: float) -> float:
    """One step's ideal seconds, priced as ``WorkloadCost.ideal`` prices a workload: its prefill FLOPs at the
    matmul rate plus, when it has decode rows, the decode step they make."""
    _check_rates(matmul_flops_per_s, copy_bytes_per_s)
    prefill_flops = costs.token_flops(work.prefill_tokens, work.prefill_pairs)
    seconds = (prefill_flops + work.prefill_sampled * costs.head_flops) / matmul_flops_per_s
    if work.decode_rows:
        seconds += costs.decode_step(work.decode_rows, work.decode_context).seconds(matmul_flops_per_s,
                                                                                    copy_bytes_per_s)
    return seconds


@dataclass(frozen=True)
class IdealTime:
    """Ideal seconds of a workload at given rates, and which bound each part hit."""

    prefill_s: float
    decode_s: float
    decode_steps: int
    compute_bound_steps: int  # decode steps whose FLOPs took longer than their bytes

    @property
    def total_s(self) -> float:
        return self.prefill_s + self.decode_s


@dataclass(frozen=True)
class WorkloadCost:
    """The work of one workload on one plan: prefill FLOPs and each decode step's rows, bytes and FLOPs."""

    prefill_tokens: int  # prompt tokens computed (a shared prefix once)
    prefill_flops: int
    steps: tuple[DecodeStep, ...]

    @property
    def decode_bytes(self) -> int:
        return sum(step.bytes for step in self.steps)

    @property
    def decode_flops(self) -> int:
        return sum(step.flops for step in self.steps)

    def ideal(self, matmul_flops_per_s: float, copy_bytes_per_s: float) -> IdealTime:
        """Ideal seconds at a matmul rate (FLOP/s) and a copy bandwidth (bytes moved per second)."""
        _check_rates(matmul_flops_per_s, copy_bytes_per_s)
        decode_s, compute_bound = 0.0, 0
        for step in self.steps:
            memory_s, compute_s = step.bytes / copy_bytes_per_s, step.flops / matmul_flops_per_s
            decode_s += max(memory_s, compute_s)
            compute_bound += compute_s > memory_s
        return IdealTime(self.prefill_flops / matmul_flops_per_s, decode_s, len(self.steps), compute_bound)


def workload_cost(plan: MemoryPlan, requests: Sequence[tuple[int, int]], shared_prefix: int = 0) -> WorkloadCost:
    """The work of ``requests`` ((prompt tokens, output tokens) each, in admission order) on ``plan``; see the
    module docstring. ``shared_prefix``: tokens every prompt starts with, computed by the first request only
    (a request whose whole prompt is the prefix still computes its last token, for its logits)."""
    _check(requests, shared_prefix)
    costs = ModelCosts.of(plan)
    tokens = pairs = 0
    for index, (prompt, _) in enumerate(requests):
        start = 0 if index == 0 else min(shared_prefix, prompt - 1)
        tokens += prompt - start
        pairs += causal_pairs(start, prompt)
    prefill = costs.token_flops(tokens, pairs) + len(requests) * costs.head_flops
    return WorkloadCost(tokens, prefill, tuple(_decode_steps(costs, requests)))


def causal_pairs(first: int, end: int) -> int:
    """(query, key) pairs of the causal queries at positions first .. end - 1: position p sees p + 1 keys."""
    return (end * (end + 1) - first * (first + 1)) // 2


def _decode_steps(costs: ModelCosts, requests: Sequence[tuple[int, int]]) -> list[DecodeStep]:
    waiting = deque((prompt, output - 1) for prompt, output in requests if output > 1)
    running: list[list[int]] = []  # [context of the next row, rows left]
    steps = []
    while waiting or running:
        while waiting and len(running) < costs.max_batch:
            prompt, rows = waiting.popleft()
            running.append([prompt + 1, rows])
        steps.append(costs.decode_step(len(running), sum(row[0] for row in running)))
        for row in running:
            row[0] += 1
            row[1] -= 1
        running = [row for row in running if row[1] > 0]
    return steps


def _check_rates(matmul_flops_per_s: float, copy_bytes_per_s: float) -> None:
    if not (matmul_flops_per_s > 0 and copy_bytes_per_s > 0):
        raise ValueError(f"rates must be > 0: matmul {matmul_flops_per_s} FLOP/s, copy {copy_bytes_per_s} B/s")


def _check(requests: Sequence[tuple[int, int]], shared_prefix: int) -> None:
    if not requests:
        raise ValueError("workload: no requests")
    for index, (prompt, output) in enumerate(requests):
        if prompt < 1 or output < 1:
            raise ValueError(f"workload request {index}: prompt {prompt} and output {output} tokens must be >= 1")
    shortest = min(prompt for prompt, _ in requests)
    if not 0 <= shared_prefix <= shortest:
        raise ValueError(f"workload shared_prefix {shared_prefix}: must be in [0, {shortest}] (the shortest prompt)")
