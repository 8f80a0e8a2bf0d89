"""Qwen3-Next and Qwen3.5-MoE: Gated DeltaNet linear attention (a state slot per sequence) with a
full-attention layer every few, and a MoE with a gated shared expert."""

from __future__ import annotations

from afdserve.model.families.gated_deltanet.cache import cache_layout
from afdserve.model.families.gated_deltanet.config import (
    ARCHITECTURES,
    MODEL_TYPES,
    parse_gdn_config,
)
from afdserve.model.families.gated_deltanet.model import HybridCausalLM
from afdserve.model.families.gated_deltanet.presets import PRESETS
from afdserve.model.families.gated_deltanet.tiny import make_tiny
from afdserve.model.parts import Family

FAMILY = Family(
    MODEL_TYPES,
    ARCHITECTURES,
    parse_gdn_config,
    HybridCausalLM,
    cache_layout,
    presets=PRESETS,
    make_tiny=make_tiny,
)
