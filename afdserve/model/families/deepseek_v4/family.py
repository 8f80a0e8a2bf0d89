"""DeepSeek-V4: mHC streams, sliding / compressed-sparse / heavily-compressed attention over its
own pages (cache.py), hash-routed and clamped-SwiGLU MoE layers."""

from __future__ import annotations

from typing import Any

from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4.cache import cache_layout
from afdserve.model.families.deepseek_v4.config import v4_model_fields
from afdserve.model.families.deepseek_v4.model import V4CausalLM
from afdserve.model.families.deepseek_v4.mtp import build_v4_mtp
from afdserve.model.parts import Family


def parse_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    # Its own parser: V4 shares no attention fields with the others and checks every key.
    return ModelConfig(**v4_model_fields(raw))


FAMILY = Family(
    ("deepseek_v4",),
    {"DeepseekV4ForCausalLM": "deepseek_v4"},
    parse_config,
    V4CausalLM,
    cache_layout,
    mtp_draft=build_v4_mtp,
)
