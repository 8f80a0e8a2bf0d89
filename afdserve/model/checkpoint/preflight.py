"""What the frontend checks of a model directory before it starts any rank: its config.json
parses (every family's field checks, DeepSeek-V4's included), the checkpoint names every tensor
the model needs, and each hash layer's `tid2eid` table covers the vocabulary with real expert ids.
Each problem is one line naming the field or tensor and what is allowed, the same line a rank's
loader would raise, but before a world of processes is spawned to find it.

Only safetensors headers and the (small) hash tables are read.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import torch
from safetensors import safe_open

from afdserve.model.checkpoint.loader import (
    CheckpointError,
    _checkpoint_files,
    _missing,
    _our_name,
    _target,
)
from afdserve.model.config import ModelConfig
from afdserve.model.families import load_model_config, model_class
from afdserve.model.layers.fp8 import SCALE_SUFFIX
from afdserve.model.parts import ModelParts
from afdserve.model.quantization import resolve_quantization


def preflight(
    model_dir: str | Path, load_format: str = "auto", quantization: str | None = None
) -> ModelConfig:
    """The model's config, once every check above passed (load_format "dummy" reads no
    checkpoint, so only the config is checked)."""
    config = load_model_config(model_dir)
    config = dataclasses.replace(
        config, quantization=resolve_quantization(config.quantization, quantization)
    )
    if load_format != "dummy":
        _check_tensors(Path(model_dir), config)
    return config


def _check_tensors(model_dir: Path, config: ModelConfig) -> None:
    with torch.device("meta"):
        model = model_class(config)(config, ModelParts.colocated())
    expected = dict(model.state_dict())
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    if config.quantization is not None and config.quantization.online:
        expected = {n: t for n, t in expected.items() if not n.endswith(SCALE_SUFFIX)}
    filled: dict[str, set] = {name: set() for name in expected}
    for path in _checkpoint_files(model_dir):
        with safe_open(str(path), framework="pt", device="cpu") as f:
            for name in f.keys():
                ours = _our_name(model, name)
                if ours is None:
                    continue
                target, expert, part = _target(ours, config.family)
                if target not in filled:
                    continue
                filled[target].add((expert, part))
                if target.endswith(".tid2eid"):
                    _check_hash_table(name, f.get_tensor(name), expected[target].shape, config)
    missing = _missing(config, expected, filled, {})
    if missing:
        shown = ", ".join(missing[:20]) + (
            f" ... ({len(missing)} in all)" if len(missing) > 20 else ""
        )
        raise CheckpointError(f"{model_dir}: checkpoint is missing tensors: {shown}")


def _check_hash_table(
    name: str, table: torch.Tensor, shape: torch.Size, config: ModelConfig
) -> None:
    """A hash layer's table: a row per token id, top_k expert ids each, every one in
    [0, num_experts) (the loader's own rules, so its messages)."""
    if table.dim() == 2 and table.shape[0] < shape[0]:
        raise CheckpointError(
            f"{name}: {table.shape[0]} rows, fewer than vocab_size="
            f"{shape[0]}: every token id needs its experts"
        )
    if tuple(table.shape) != tuple(shape):
        raise CheckpointError(
            f"{name}: shape {tuple(table.shape)} in the checkpoint, the config "
            f"implies {tuple(shape)}"
        )
    low, high = int(table.min()), int(table.max())
    if low < 0 or high >= config.num_experts:
        bad = low if low < 0 else high
        raise CheckpointError(
            f"{name} holds expert id {bad}, outside [0, {config.num_experts})"
            " (the config's number of routed experts)"
        )
