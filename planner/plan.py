"""``build_plan``: frozen configs in, a validated ``MemoryPlan`` out.

The plan is the contract with the executor: every pool and buffer with its
dtype, shape, offset and bytes; every capacity; the per-rank geometry; and the
budget. The startup reserve is one checked non-KV total, computed once and used
both by the fit check and by the KV-pool subtraction (invariant 2, docs/design.md).
"""

from __future__ import annotations

from fractions import Fraction
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner import checked
from planner.attention_plan import build_attention_plan
from planner.capacity import Capacity, build_capacity, gemv_batch_limit, with_kv_pages
from planner.config import (
    HardwareConfig, ModelConfig, ServingConfig, check_compatible, resolve_prefill_attention, resolved_dtypes)
from planner.dtypes import dtype_bytes
from planner.errors import PlanDoesNotFit
from planner.geometry import Geometry, build_geometry
from planner.kv_cache import build_kv_cache, build_recurrent_state, kv_page_bytes
from planner.layout import ALIGNMENT_BYTES, Pool, budget_pool
from planner.sampling import build_sampling
from planner.step_buffers import STAGES, build_step_pool
from planner.weights import build_weights

SCHEMA_VERSION = 1


class Dtypes(BaseModel):
    """Resolved dtypes of the plan's data."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    weights: str
    activations: str
    kv_cache: str
    recurrent_state: str = "float32"


class BudgetLine(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    bytes: int = Field(ge=0)


class Budget(BaseModel):
    """Device memory of one rank, bytes. usable = non_kv + kv + free."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    device_bytes: int = Field(ge=0, description="the hardware's total device memory")
    usable_bytes: int = Field(ge=0, description="device_bytes x gpu_memory_utilization, rounded down")
    non_kv_bytes: int = Field(ge=0, description="every pool but kv_cache, runtime lines included")
    kv_bytes: int = Field(ge=0, description="the KV pool")
    free_bytes: int = Field(ge=0, description="usable bytes left after the KV pool (under one page)")
    lines: tuple[BudgetLine, ...] = Field(description="every pool and runtime line, in pool order")


class MemoryPlan(BaseModel):
    """A complete memory plan for one rank."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    schema_version: Literal[1] = SCHEMA_VERSION
    model: ModelConfig
    hardware: HardwareConfig
    serving: ServingConfig
    dtypes: Dtypes
    geometry: Geometry
    capacity: Capacity
    stages: tuple[str, ...] = Field(description="stage names; transient buffers' live ranges index these")
    pools: tuple[Pool, ...]
    budget: Budget

    def pool(self, name: str) -> Pool:
        for pool in self.pools:
            if pool.name == name:
                return pool
        raise KeyError(f"plan has no pool {name!r}; pools: {', '.join(p.name for p in self.pools)}")


def resolve_dtypes(model: ModelConfig, serving: ServingConfig) -> Dtypes:
    activations, kv = resolved_dtypes(model, serving)
    return Dtypes(weights=activations, activations=activations, kv_cache=kv)


def build_plan(model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig, *,
               serving_source: str = "serving") -> MemoryPlan:
    """Lay out every buffer, size the KV pool from what is left, and return the plan.

    Raises ConfigError for inconsistent configs (naming ``serving_source``, the serving config's
    file, for a serving field the model rules out), CheckedOverflowError when a quantity leaves
    its width, PlanDoesNotFit when fewer than ``serving.min_kv_pages`` KV pages remain.
    """
    draft = _draft(model, hardware, serving, serving_source)
    page_bytes = kv_page_bytes(draft.geometry, serving.page_size, draft.dtypes.kv_cache)
    if not _leaves_min_kv_pages(draft, page_bytes, serving):
        from planner.fit import explain_does_not_fit  # local: fit calls plan_fits

        raise explain_does_not_fit(model, hardware, serving, draft.non_kv_bytes, draft.usable_bytes, page_bytes,
                                   draft.pools)
    kv_pages = _kv_pages(draft.available_bytes, page_bytes)
    kv_pool = build_kv_cache(draft.geometry, serving.page_size, draft.dtypes.kv_cache, kv_pages)
    pools = (draft.pools[0], kv_pool, *draft.pools[1:])
    kv_bytes = kv_pool.bytes
    budget = Budget(
        device_bytes=hardware.device_memory_bytes,
        usable_bytes=draft.usable_bytes,
        non_kv_bytes=draft.non_kv_bytes,
        kv_bytes=kv_bytes,
        free_bytes=checked.sub("free bytes", draft.available_bytes, kv_bytes),
        lines=tuple(BudgetLine(name=p.name, bytes=p.bytes) for p in pools),
    )
    return MemoryPlan(
        model=model, hardware=hardware, serving=serving, dtypes=draft.dtypes, geometry=draft.geometry,
        capacity=with_kv_pages(draft.capacity, kv_pages), stages=STAGES, pools=pools, budget=budget,
    )


def plan_fits(model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig) -> bool:
    """Whether ``build_plan`` would succeed (it raises ConfigError for invalid configs)."""
    draft = _draft(model, hardware, serving)
    return _leaves_min_kv_pages(draft, kv_page_bytes(draft.geometry, serving.page_size, draft.dtypes.kv_cache), serving)


def _leaves_min_kv_pages(draft: _Draft, page_bytes: int, serving: ServingConfig) -> bool:
    return draft.available_bytes >= 0 and _kv_pages(draft.available_bytes, page_bytes) >= serving.min_kv_pages


class _Draft(BaseModel):
    """Everything but the KV pool, and the one non-KV total."""

    model_config = ConfigDict(frozen=True)

    dtypes: Dtypes
    geometry: Geometry
    capacity: Capacity
    pools: tuple[Pool, ...]
    non_kv_bytes: int
    usable_bytes: int
    available_bytes: int  # usable - non_kv; negative when even the non-KV pools do not fit


def _draft(model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig,
           serving_source: str = "serving") -> _Draft:
    check_compatible(model, serving, serving_source)
    dtypes = resolve_dtypes(model, serving)
    geometry = build_geometry(model, serving)
    gemv_inputs = (geometry.hidden_size, geometry.attn_out_width, geometry.intermediate_size,
                   *((geometry.linear_value_width,) if geometry.num_linear_layers else ()))
    capacity = build_capacity(
        max_batch=serving.max_batch,
        max_context=serving.max_context or model.max_position_embeddings,
        page_size=serving.page_size,
        max_prefill_tokens=serving.max_prefill_tokens,
        gqa_group=geometry.gqa_group,
        num_q_heads=geometry.num_q_heads if geometry.num_full_layers else 0,
        gemm_attention_min_tokens=serving.gemm_attention_min_tokens,
        prefill_attention=resolve_prefill_attention(model, serving),
        recurrent_slots_per_request=serving.states_per_slot if geometry.num_linear_layers else 0,
        decode_gemv_batch=gemv_batch_limit(serving.decode_gemv_max_batch, serving.max_batch, geometry.hidden_size,
                                           gemv_inputs, dtype_bytes(dtypes.activations)),
    )
    act = dtypes.activations
    pools = [build_weights(geometry, dtypes.weights, model.tie_word_embeddings)]
    if geometry.num_linear_layers:
        pools.append(build_recurrent_state(geometry, capacity.recurrent_slots, act, capacity.max_batch))
    pools += [
        build_attention_plan(capacity),
        build_step_pool("decode", geometry, capacity.max_batch, act, capacity.decode_kv_splits),
        build_step_pool("prefill", geometry, capacity.max_tokens_per_step, act,
                        gather_tokens=capacity.prefill_gather_tokens, score_elements=capacity.prefill_score_elements),
        build_sampling(geometry, capacity.max_batch, act),
        budget_pool("runtime", _runtime_lines(hardware, serving)),
    ]
    non_kv = checked.add("non-KV bytes", *(p.bytes for p in pools))
    usable = _usable_bytes(hardware.device_memory_bytes, serving.gpu_memory_utilization)
    return _Draft(dtypes=dtypes, geometry=geometry, capacity=capacity, pools=tuple(pools), non_kv_bytes=non_kv,
                  usable_bytes=usable, available_bytes=checked.sub("bytes left for KV", usable, non_kv, width=checked.I64))


def _runtime_lines(hardware: HardwareConfig, serving: ServingConfig) -> list[tuple[str, int]]:
    lines = [(line.name, line.bytes) for line in hardware.runtime_reserve]
    graphs = checked.mul("cuda_graphs bytes", len(serving.decode_graph_batch_sizes), hardware.cuda_graph_bytes)
    return [*lines, ("cuda_graphs", graphs)]


def _usable_bytes(device_bytes: int, utilization: float) -> int:
    """floor(device_bytes x utilization), exact: the float's decimal text as a fraction."""
    share = Fraction(repr(utilization))
    return checked.fit("usable bytes", (device_bytes * share.numerator) // share.denominator)


def _kv_pages(available_bytes: int, page_bytes: int) -> int:
    """Most pages whose aligned pool fits in ``available_bytes``."""
    pages = checked.floordiv("kv pages", available_bytes, page_bytes, width=checked.I32)
    while checked.align_up("kv pool bytes", pages * page_bytes, ALIGNMENT_BYTES) > available_bytes:
        pages -= 1
    return pages
