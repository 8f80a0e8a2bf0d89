"""The active parameters a prefill's FLOPs are counted from (bench/flops.py), against
transformers' own module tree of the same config on the meta device."""

from __future__ import annotations

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from afdserve.bench.flops import active_parameters
from afdserve.model.families import parse_model_config
from afdserve.model.presets import preset_hf_config


def hf_active(raw: dict, top_k: int, experts: int) -> int:
    """transformers' parameters one token multiplies through: all but the embedding, each
    routed expert's matrices at top_k / experts."""
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    total = 0.0
    for name, p in model.named_parameters():
        if "embed_tokens" in name or p.dim() < 2 or ".gate.weight" in name:
            continue
        routed = ".experts." in name and "shared" not in name
        total += p.numel() * (top_k / experts if routed else 1.0)
    return int(total)


def test_qwen3_30b_a3b_active_parameters_match_transformers() -> None:
    raw = preset_hf_config("qwen3-30b-a3b:2")
    config = parse_model_config(raw)
    ours = active_parameters(config)
    # transformers skips the router in this count: add it back, as ours holds it.
    routers = config.num_layers * config.num_experts * config.hidden_size
    assert ours == hf_active(raw, config.top_k, config.num_experts) + routers
