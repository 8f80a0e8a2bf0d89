"""The hybrid presets' per-layer schedules read as transformers reads the same config.json: which
layers are full attention and which MLPs are dense. A preset that leaves a schedule to a default
(Kimi-Linear's MLA layers are published, not every fourth) fails here."""

from __future__ import annotations

import pytest
from transformers import KimiLinearConfig, Qwen3_5MoeTextConfig, Qwen3NextConfig

from afdserve.model.presets import preset_config, preset_hf_config

ORACLES = {
    "kimi-linear-48b-a3b": KimiLinearConfig,
    "qwen3-next-80b-a3b": Qwen3NextConfig,
    "qwen3.5-35b-a3b": Qwen3_5MoeTextConfig,
}


@pytest.mark.parametrize("name", sorted(ORACLES))
def test_schedules_are_transformers(name: str) -> None:
    raw = preset_hf_config(name)
    hf = ORACLES[name](**{k: v for k, v in raw.items() if k != "rope_scaling"})
    config = preset_config(name)
    assert config.family_config.attention_types == tuple(hf.layer_types)
    dense = [i for i, kind in enumerate(config.layer_types) if kind == "dense"]
    if name == "kimi-linear-48b-a3b":
        assert dense == [i for i, kind in enumerate(hf.mlp_layer_types) if kind == "dense"] == [0]
        full = config.family_config.layers_of("full_attention")
        assert [i + 1 for i in full] == raw["linear_attn_config"]["full_attn_layers"]
    else:
        assert dense == []
