from __future__ import annotations

import pytest

from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan

TINY_MODELS = ("tiny-qwen3", "tiny-qwen3-g5", "tiny-qwen3.5", "tiny-qwen3.5-g6")
REAL_MODELS = ("qwen3-0.6b", "qwen3-4b", "qwen3-8b", "qwen3-14b", "qwen3-32b",
               "qwen3.5-0.8b", "qwen3.5-4b", "qwen3.5-9b", "qwen3.5-27b")


@pytest.fixture
def plan_for():
    def make(model: str, hardware: str = "h200", serving: str = "default", **overrides):
        return build_plan(load_model(model), load_hardware(hardware), load_serving(serving, overrides))

    return make
