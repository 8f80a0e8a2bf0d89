"""Shared fixtures: one tiny checkpoint per family (plain and with hash-routed layers), built once
per test session, plus the Hugging Face model of each, the oracle the parity tests compare to."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from afdserve.model.fixtures.tiny import FAMILIES, make_tiny_model

# How many hash-routed layers each family's hash variant gets: both 1 and 2 are covered, and
# DeepSeek-V3 (sigmoid scores) and the softmax families are both among them.
HASH_LAYERS = {"qwen3_moe": 1, "deepseek_v2": 2, "deepseek_v3": 2, "mixtral": 1}


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--run-slow",
        action="store_true",
        default=False,
        help="also run the tests marked slow (the full multi-process matrices); "
        "$AFDSERVE_RUN_SLOW=1 does the same",
    )


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    # The CI box has two cores: the wide matrices run one representative cell each there, and the
    # rest is one flag away rather than deleted.
    if config.getoption("--run-slow") or os.environ.get("AFDSERVE_RUN_SLOW") == "1":
        return
    skip = pytest.mark.skip(reason="slow matrix cell: run with --run-slow")
    for item in items:
        if "slow" in item.keywords:
            item.add_marker(skip)


def pytest_configure(config: pytest.Config) -> None:
    # The tiny models' tensors gain nothing from intra-op threads, and on a busy 2-core machine
    # the pool's contention turns a 0.1 s decode loop into tens of seconds.
    torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> directory of a tiny float32 checkpoint without hash layers (seed 0)."""
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(root / family, family, seed=0) for family in FAMILIES}


@pytest.fixture(scope="session")
def hash_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """family -> directory of a tiny checkpoint whose first HASH_LAYERS[family] MoE layers are
    hash-routed (seed 1, so its weights differ from `tiny_models`)."""
    root = tmp_path_factory.mktemp("tiny-hash")
    return {
        family: make_tiny_model(root / family, family, hash_layers=HASH_LAYERS[family], seed=1)
        for family in FAMILIES
    }


@pytest.fixture(scope="session")
def hf_models(tiny_models: dict[str, Path]) -> dict[str, torch.nn.Module]:
    """family -> transformers' own model loaded from the same directory, float32, eval mode."""
    from transformers import AutoModelForCausalLM

    return {
        family: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        for family, path in tiny_models.items()
    }
