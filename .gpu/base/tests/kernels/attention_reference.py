"""float64 causal attention of a request's query chunk: the flash kernel's test and bench reference."""

from __future__ import annotations

import math

import torch


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_len: int,
                     rows: torch.Tensor | None = None) -> torch.Tensor:
    """q [R, Hq, D], the last R of a request's kv_len tokens (row r at position kv_len - R + r), over
    k, v [Hkv, >= kv_len, D] (GatherKv's layout; q head h reads kv head h // (Hq / Hkv)). Returns
    float64 [R', Hq, D] for the query rows ``rows`` (default: all R), so a long prompt's check need
    not hold all R x kv_len scores."""
    num_rows, q_heads, head_dim = q.shape
    rows = torch.arange(num_rows, device=q.device) if rows is None else rows
    group = q_heads // k.shape[0]
    keys = k[:, :kv_len].double().repeat_interleave(group, dim=0)
    values = v[:, :kv_len].double().repeat_interleave(group, dim=0)
    scores = torch.einsum("rhd,hkd->hrk", q[rows].double(), keys) / math.sqrt(head_dim)
    positions = rows[:, None] + kv_len - num_rows
    scores = scores.masked_fill(torch.arange(kv_len, device=q.device)[None, :] > positions, -math.inf)
    return torch.einsum("hrk,hkd->rhd", scores.softmax(-1), values)
