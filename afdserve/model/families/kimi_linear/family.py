"""Kimi-Linear: Kimi Delta Attention (a state slot per sequence, gated_deltanet/cache.py) with an
MLA layer every few (its latent in the paged cache), and a MoE with shared experts."""

from __future__ import annotations

from afdserve.model.cache import CacheLayout, PagedKV
from afdserve.model.config import ModelConfig
from afdserve.model.families.gated_deltanet.cache import DeltaNetState
from afdserve.model.families.kimi_linear.config import FULL, LINEAR, parse_kimi_config
from afdserve.model.families.kimi_linear.model import KimiLinearCausalLM
from afdserve.model.families.kimi_linear.presets import PRESETS
from afdserve.model.families.kimi_linear.tiny import make_tiny
from afdserve.model.parts import Family


def cache_layout(config: ModelConfig) -> CacheLayout:
    kimi = config.family_config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    full = PagedKV(kimi.layers_of(FULL), 1, latent, tensors_per_layer=1)
    state = DeltaNetState(
        kimi.layers_of(LINEAR),
        3 * kimi.qkv_dim,
        kimi.conv_kernel,
        kimi.num_heads,
        kimi.head_dim,
        kimi.head_dim,
        kind="KDA",
    )
    return CacheLayout(tuple(s for s in (full, state) if s.layers), config.num_layers)


FAMILY = Family(
    ("kimi_linear",),
    {"KimiLinearForCausalLM": "kimi_linear"},
    parse_kimi_config,
    KimiLinearCausalLM,
    cache_layout,
    presets=PRESETS,
    make_tiny=make_tiny,
)
