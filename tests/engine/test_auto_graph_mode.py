"""What graph_mode "auto" becomes on CUDA, by the model's cache layout and max_model_len."""

from __future__ import annotations

import pytest

from afdserve.engine.cuda_graphs import auto_graph_mode
from afdserve.model.families.deepseek_v4.cache import GRAPH_CONTEXT_LIMIT
from afdserve.model.presets import preset_config

LIMIT = GRAPH_CONTEXT_LIMIT[0]


@pytest.mark.parametrize("max_model_len", [1024, LIMIT])
def test_v4_captures_decode_by_default_up_to_the_measured_context(max_model_len):
    config = preset_config("deepseek-v4-flash:2")
    assert auto_graph_mode(config, "full_decode_only", max_model_len) == ("full_decode_only", None)


def test_v4_stays_eager_past_it_and_says_why():
    config = preset_config("deepseek-v4-flash:2")
    mode, why = auto_graph_mode(config, "full_decode_only", LIMIT + 1)
    assert mode == "none"
    assert f"max_model_len={LIMIT + 1} > {LIMIT}" in why and "full_decode_only" in why


@pytest.mark.parametrize("max_model_len", [LIMIT + 1, 1 << 20])
def test_other_families_capture_at_any_context(max_model_len):
    config = preset_config("qwen3-30b-a3b:2")
    assert auto_graph_mode(config, "full_decode_only", max_model_len) == ("full_decode_only", None)


def test_auto_on_cpu_stays_none():
    config = preset_config("deepseek-v4-flash:2")
    assert auto_graph_mode(config, "none", 1024) == ("none", None)
