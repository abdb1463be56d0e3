"""The executor: materialize a plan, load weights, run the model.

``from executor import LLM, SamplingParams`` is the Python API (executor.api); the names load on first
use, so ``import executor`` imports neither torch nor numba.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "RequestOutput", "SamplingParams"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from executor import api

        return getattr(api, name)
    raise AttributeError(f"module 'executor' has no attribute {name!r}")
