"""DeepSeek-V3.2 and GLM-5: MLA with DeepSeek Sparse Attention, DeepSeek-V3's MoE."""

from __future__ import annotations

from afdserve.model.families.dsa.cache import cache_layout
from afdserve.model.families.dsa.config import ARCHITECTURES, MODEL_TYPES, parse_dsa_config
from afdserve.model.families.dsa.model import DSACausalLM
from afdserve.model.families.dsa.presets import PRESETS
from afdserve.model.families.dsa.tiny import make_tiny_dsa
from afdserve.model.parts import Family

FAMILY = Family(
    MODEL_TYPES,
    ARCHITECTURES,
    parse_dsa_config,
    DSACausalLM,
    cache_layout,
    presets=PRESETS,
    make_tiny=make_tiny_dsa,
)
