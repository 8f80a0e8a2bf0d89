"""gpt-oss: GQA with sinks and alternating sliding-window layers, a biased router and clamped
SwiGLU experts with biases, bf16 or MXFP4 (model.py, quant.py)."""

from __future__ import annotations

from afdserve.model.families.gpt_oss.cache import cache_layout
from afdserve.model.families.gpt_oss.config import (
    ARCHITECTURES,
    MODEL_TYPES,
    parse_gpt_oss_config,
)
from afdserve.model.families.gpt_oss.model import GptOssCausalLM
from afdserve.model.families.gpt_oss.presets import PRESETS
from afdserve.model.families.gpt_oss.tiny import make_tiny_gpt_oss
from afdserve.model.parts import Family

FAMILY = Family(
    MODEL_TYPES,
    ARCHITECTURES,
    parse_gpt_oss_config,
    GptOssCausalLM,
    cache_layout,
    presets=PRESETS,
    make_tiny=make_tiny_gpt_oss,
)
