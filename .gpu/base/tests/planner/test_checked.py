"""Checked arithmetic and the capacities that must fit i32."""

from __future__ import annotations

import pytest

from planner import checked
from planner.capacity import build_capacity
from planner.checked import CheckedOverflowError
from planner.config import ModelConfig
from planner.loader import load_hardware, load_model, load_serving
from planner.plan import build_plan


def test_widths_accept_their_bounds_and_reject_one_past():
    assert checked.fit("x", 2**31 - 1, checked.I32) == 2**31 - 1
    assert checked.mul("x", 2**32, 2**32 - 1, width=checked.U64) == 2**64 - 2**32
    with pytest.raises(CheckedOverflowError, match=r"x overflows u64: mul\(4,294,967,296, 4,294,967,296\)"):
        checked.mul("x", 2**32, 2**32, width=checked.U64)
    with pytest.raises(CheckedOverflowError, match="overflows u32"):
        checked.sub("y", 1, 2, width=checked.U32)
    with pytest.raises(CheckedOverflowError, match="overflows i32"):
        checked.add("z", 2**30, 2**30, width=checked.I32)


def test_an_intermediate_overflow_is_caught_even_if_the_end_result_fits():
    with pytest.raises(CheckedOverflowError):
        checked.mul("w", 2**40, 2**40, 0, width=checked.U64)


@pytest.mark.parametrize(
    ("dimension", "overrides"),
    [
        ("logical_pages", dict(max_batch=65536, max_context=1 << 24, page_size=1)),
        ("tiles", dict(max_prefill_tokens=1 << 20, gqa_group=4096)),
        ("max_tokens_per_step", dict(max_prefill_tokens=2**31 - 1, max_batch=2)),
    ],
)
def test_capacities_past_i32_fail_naming_the_dimension(dimension, overrides):
    values = dict(max_batch=8, max_context=1024, page_size=16, max_prefill_tokens=512, gqa_group=4,
                  recurrent_slots_per_request=0)
    with pytest.raises(CheckedOverflowError, match=rf"^{dimension}.* overflows i32"):
        build_capacity(**{**values, **overrides})


def test_a_buffer_dimension_past_i32_fails_in_the_plan():
    """A vocab-by-token logits buffer is fine; a 2^31-row step buffer is not."""
    model = load_model("qwen3-0.6b")
    huge = ModelConfig.model_validate({**model.model_dump(), "max_position_embeddings": 1 << 24})
    serving = load_serving("default", {"max_batch": 65536, "max_context": 1 << 24, "page_size": 1,
                                       "decode_graph_batch_sizes": (1,)})
    with pytest.raises(CheckedOverflowError, match="logical_pages.*i32"):
        build_plan(huge, load_hardware("h200"), serving)
