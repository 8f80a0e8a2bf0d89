"""Qwen3-MoE, Mixtral, DeepSeek-V2 and V3: one decoder (model.py), GQA or MLA attention over the
plain paged KV cache."""

from __future__ import annotations

from afdserve.model.cache import CacheLayout, PagedKV
from afdserve.model.config import ModelConfig
from afdserve.model.families.decoder.config import (
    ARCHITECTURES,
    MODEL_TYPES,
    parse_decoder_config,
)
from afdserve.model.families.decoder.model import MoECausalLM
from afdserve.model.families.decoder.mtp import build_mtp
from afdserve.model.parts import Family


def cache_layout(config: ModelConfig) -> CacheLayout:
    """Every layer caches keys and values per KV head (GQA), or one latent (MLA)."""
    tensors = 1 if config.attention == "mla" else 2
    spec = PagedKV(
        tuple(range(config.num_layers)), config.num_cache_heads, config.kv_cache_dim, tensors
    )
    return CacheLayout((spec,), config.num_layers)


FAMILY = Family(
    MODEL_TYPES,
    ARCHITECTURES,
    parse_decoder_config,
    MoECausalLM,
    cache_layout,
    mtp_draft=build_mtp,
)
