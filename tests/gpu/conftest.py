from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from afdserve.model.presets import preset_hf_config

# Experts of WIDE_EXPERT_BYTES in bf16 (64 experts x 3 x 1024 x 2048 x 8 layers x 2 bytes): large
# against the KV blocks of the tiny preset's attention, so that where they sit shows in the cache.
WIDE_EXPERT_BYTES = 64 * 3 * 1024 * 2048 * 8 * 2


@pytest.fixture
def wide_model(tmp_path: Path) -> Path:
    """The tiny preset with 6.4 GB of bf16 experts."""
    config = preset_hf_config("tiny")
    config.update(
        hidden_size=1024,
        moe_intermediate_size=2048,
        num_experts=64,
        num_hidden_layers=8,
        torch_dtype="bfloat16",
    )
    model = tmp_path / "wide"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(config))
    return model


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; runs on the GPU machine (tests/gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
