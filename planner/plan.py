"""``build_plan``: frozen configs in, a validated ``MemoryPlan`` out.

The plan is the contract with the executor: every pool and buffer with its
dtype, shape, offset and bytes; every capacity; the per-rank geometry; and the
budget. The startup reserve is one checked non-KV total, computed once and used
both by the fit check and by the KV-pool subtraction (invariant 2, docs/design.md). A plan fits
only when its KV pool holds one request of max_context (the padding page 0 not
counted); otherwise PlanDoesNotFit names the largest max_context that fits and
the gpu_memory_utilization that would fit this one.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from planner import checked
from planner.capacity import Capacity, with_kv_pages
from planner.concurrency import concurrency_fields, largest_context_holding
from planner.config import HardwareConfig, ModelConfig, ServingConfig
from planner.draft import Draft, Drafter, Dtypes, resolve_dtypes
from planner.fit import explain_does_not_fit
from planner.geometry import Geometry
from planner.kv_cache import build_kv_cache
from planner.layout import Pool
from planner.step_buffers import STAGES

__all__ = ["Budget", "BudgetLine", "Dtypes", "MemoryPlan", "build_plan", "plan_fits", "resolve_dtypes"]

SCHEMA_VERSION = 1


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


def build_plan(model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig, *,
               serving_source: str = "serving") -> MemoryPlan:
    """Lay out every buffer, size the KV pool from what is left, and return the plan.

    Raises ConfigError for inconsistent configs (naming ``serving_source``, the serving config's
    file, for a serving field the model rules out), CheckedOverflowError when a quantity leaves
    its width, PlanDoesNotFit when the KV pool cannot hold one request of max_context.
    """
    drafter = Drafter(model, hardware, serving_source)
    draft = _draft_at_context(drafter, serving)
    if not draft.holds(1):
        raise explain_does_not_fit(drafter, draft)
    kv_pages = draft.kv_pages
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
    capacity = with_kv_pages(draft.capacity, kv_pages).model_copy(update=concurrency_fields(drafter, draft))
    return MemoryPlan(
        model=model, hardware=hardware, serving=serving, dtypes=draft.dtypes, geometry=draft.geometry,
        capacity=capacity, stages=STAGES, pools=pools, budget=budget,
    )


def plan_fits(model: ModelConfig, hardware: HardwareConfig, serving: ServingConfig) -> bool:
    """Whether ``build_plan`` would succeed (it raises ConfigError for invalid configs)."""
    return _draft_at_context(Drafter(model, hardware), serving).holds(1)


def _draft_at_context(drafter: Drafter, serving: ServingConfig) -> Draft:
    """The draft at serving's max_context; for "auto", at the largest context up to the model's limit of
    which one request fits (or at the limit when none does: the caller reports it)."""
    limit = drafter.draft(serving)  # at context_limit: the model's max_position_embeddings for auto
    if serving.max_context != "auto" or limit.holds(1):
        return limit
    context = largest_context_holding(drafter, limit, 1, limit.capacity.max_context - 1)
    return limit if context is None else drafter.draft(serving, context)
