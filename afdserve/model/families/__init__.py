"""The model families afdserve serves, by config.json's model_type. Each family maps its config
to a ModelConfig, names its model class and describes its per-sequence state (model/cache.py);
nothing above model/ asks which family it runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from afdserve.model.cache import CacheLayout
from afdserve.model.config import ModelConfig, read_hf_config
from afdserve.model.families.decoder.family import FAMILY as DECODER
from afdserve.model.families.deepseek_v4.family import FAMILY as DEEPSEEK_V4
from afdserve.model.families.dsa.family import FAMILY as DSA
from afdserve.model.families.gated_deltanet.family import FAMILY as GATED_DELTANET
from afdserve.model.families.gpt_oss.family import FAMILY as GPT_OSS
from afdserve.model.families.kimi_linear.family import FAMILY as KIMI_LINEAR
from afdserve.model.families.minimax_m2.family import FAMILY as MINIMAX_M2
from afdserve.model.parts import Family

REGISTERED = (DECODER, DEEPSEEK_V4, MINIMAX_M2, GPT_OSS, DSA, GATED_DELTANET, KIMI_LINEAR)
FAMILIES = tuple(t for family in REGISTERED for t in family.model_types)
ARCHITECTURES = {a: t for family in REGISTERED for a, t in family.architectures.items()}


def detect_family(raw: dict[str, Any]) -> str:
    model_type = raw.get("model_type")
    if model_type in FAMILIES:
        return model_type
    for arch in raw.get("architectures") or ():
        if arch in ARCHITECTURES:
            return ARCHITECTURES[arch]
    raise ValueError(
        f"unknown model family: model_type={model_type!r}, "
        f"architectures={raw.get('architectures')!r}; "
        f"supported model_type values: {FAMILIES}"
    )


def family_of(model_type: str) -> Family:
    for family in REGISTERED:
        if model_type in family.model_types:
            return family
    raise ValueError(f"model family {model_type!r} is not supported: one of {FAMILIES}")


def parse_model_config(raw: dict[str, Any]) -> ModelConfig:
    model_type = detect_family(raw)
    return family_of(model_type).parse_config(raw, model_type)


def load_model_config(model_dir: str | Path) -> ModelConfig:
    return parse_model_config(read_hf_config(model_dir))


def model_class(config: ModelConfig) -> type:
    return family_of(config.family).model_class


def cache_layout(config: ModelConfig) -> CacheLayout:
    """The state the model's layers keep per sequence, group by group."""
    return family_of(config.family).cache_layout(config)
