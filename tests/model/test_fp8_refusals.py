"""What afdserve refuses of a quantized checkpoint, by name and before it serves a token: a
quantization_config it cannot honour, an FP8 tensor whose scale is missing, misshapen or not
float32, FP8 values where no scale can apply, and a quantization option it does not know."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from afdserve import LLM
from afdserve.config import EngineConfig
from afdserve.model.checkpoint.loader import CheckpointError, load_model
from afdserve.model.fixtures.fp8_checkpoint import quantize_checkpoint
from afdserve.model.parts import ModelParts

EXPERT_SCALE = "model.layers.2.mlp.experts.3.up_proj.weight_scale_inv"
ATTENTION_SCALE = "model.layers.1.self_attn.k_proj.weight_scale_inv"


@pytest.fixture(scope="module")
def fp8_qwen(tiny_models: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    return quantize_checkpoint(
        shutil.copytree(tiny_models["qwen3_moe"], tmp_path_factory.mktemp("fp8") / "qwen3_moe")
    )


def copy_with(
    src: Path,
    dst: Path,
    config: dict | None = None,
    weights: dict[str, torch.Tensor | None] | None = None,
) -> Path:
    """A copy of `src` with quantization_config entries and tensors replaced (None: removed)."""
    shutil.copytree(src, dst)
    if config is not None:
        raw = json.loads((dst / "config.json").read_text())
        raw["quantization_config"] = {**raw.get("quantization_config", {}), **config}
        raw["quantization_config"] = {
            k: v for k, v in raw["quantization_config"].items() if v is not None
        }
        (dst / "config.json").write_text(json.dumps(raw))
    if weights is not None:
        tensors = load_file(dst / "model.safetensors")
        for name, tensor in weights.items():
            if tensor is None:
                del tensors[name]
            else:
                tensors[name] = tensor
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize(
    ("entry", "message"),
    [
        ({"quant_method": "awq"}, "quant_method='awq'"),
        ({"quant_method": "compressed-tensors"}, "quant_method='compressed-tensors'"),
        ({"weight_block_size": [64, 64]}, r"weight_block_size=\[64, 64\]"),
        ({"weight_block_size": None}, "weight_block_size=None"),  # per-tensor FP8
        ({"fmt": "e5m2"}, "fmt='e5m2'"),
        ({"activation_scheme": "static"}, "activation_scheme='static'"),
    ],
)
def test_unsupported_quantization_config_is_refused_before_loading(
    fp8_qwen: Path, tmp_path: Path, entry: dict, message: str
) -> None:
    path = copy_with(fp8_qwen, tmp_path / "model", config=entry)
    for build in (
        lambda: load_model(path, ModelParts.colocated(), "float32"),
        lambda: LLM(str(path), dtype="float32"),
        lambda: LLM(str(path), dtype="float32", topology="1A1F"),
    ):
        with pytest.raises(ValueError, match=f"quantization_config.{message}"):
            build()


@pytest.mark.parametrize("missing", [EXPERT_SCALE, ATTENTION_SCALE])
def test_missing_scale_is_named(fp8_qwen: Path, tmp_path: Path, missing: str) -> None:
    path = copy_with(fp8_qwen, tmp_path / "model", weights={missing: None})
    with pytest.raises(CheckpointError, match=re.escape(missing)) as err:
        load_model(path, ModelParts.colocated(), "float32")
    assert "missing" in str(err.value) and err.value.args[0].count("weight_scale_inv") == 1
    # Only the half that holds the weight needs its scale.
    other = (
        ModelParts(attention=True, ffn=False)
        if "experts" in missing
        else ModelParts(attention=False, ffn=True)
    )
    load_model(path, other, "float32")


@pytest.mark.parametrize("name", [EXPERT_SCALE, ATTENTION_SCALE])
def test_scale_of_the_wrong_shape_names_the_expected_grid(
    fp8_qwen: Path, tmp_path: Path, name: str
) -> None:
    path = copy_with(fp8_qwen, tmp_path / "model", weights={name: torch.ones(2, 1)})
    with pytest.raises(CheckpointError, match=re.escape(name) + r".*\(2, 1\).*expected \(1, 1\)"):
        load_model(path, ModelParts.colocated(), "float32")


def test_scale_that_is_not_float32_is_refused(fp8_qwen: Path, tmp_path: Path) -> None:
    path = copy_with(
        fp8_qwen, tmp_path / "model", weights={EXPERT_SCALE: torch.ones(1, 1, dtype=torch.bfloat16)}
    )
    with pytest.raises(CheckpointError, match=re.escape(EXPERT_SCALE) + ".*bfloat16.*float32"):
        load_model(path, ModelParts.colocated(), "float32")


def test_fp8_weights_without_a_quantization_config_are_refused(
    fp8_qwen: Path, tmp_path: Path
) -> None:
    """What used to load with its scales reported as unexpected and serve wrong tokens."""
    path = copy_with(fp8_qwen, tmp_path / "model")
    raw = json.loads((path / "config.json").read_text())
    del raw["quantization_config"]
    (path / "config.json").write_text(json.dumps(raw))
    for quantization in (None, "fp8"):
        with pytest.raises(CheckpointError, match="float8_e4m3fn.*no quantization_config"):
            load_model(path, ModelParts.colocated(), "float32", quantization=quantization)


def test_a_plain_weight_where_fp8_is_expected_is_refused(fp8_qwen: Path, tmp_path: Path) -> None:
    name = "model.layers.1.self_attn.k_proj.weight"
    plain = load_file(fp8_qwen / "model.safetensors")[name].float()
    path = copy_with(fp8_qwen, tmp_path / "model", weights={name: plain})
    with pytest.raises(CheckpointError, match=re.escape(name) + ".*modules_to_not_convert"):
        load_model(path, ModelParts.colocated(), "float32")


def test_fp8_weight_of_a_module_kept_unquantized_is_refused(fp8_qwen: Path, tmp_path: Path) -> None:
    path = copy_with(
        fp8_qwen,
        tmp_path / "model",
        config={"modules_to_not_convert": ["model.layers.1.self_attn"]},
    )
    with pytest.raises(CheckpointError, match=r"model\.layers\.1\.self_attn\..*float32"):
        load_model(path, ModelParts.colocated(), "float32")


def test_experts_of_one_layer_are_all_fp8_or_none(fp8_qwen: Path, tmp_path: Path) -> None:
    path = copy_with(
        fp8_qwen,
        tmp_path / "model",
        config={"modules_to_not_convert": ["model.layers.2.mlp.experts.3"]},
    )
    with pytest.raises(ValueError, match=r"model\.layers\.2\.mlp\.experts.*all FP8 or none"):
        load_model(path, ModelParts.colocated(), "float32")


def test_unknown_quantization_option_is_refused(fp8_qwen: Path) -> None:
    with pytest.raises(ValueError, match="EngineConfig.quantization='int8'"):
        EngineConfig(model=str(fp8_qwen), quantization="int8")
    with pytest.raises(ValueError, match="quantization='awq'"):
        load_model(fp8_qwen, ModelParts.colocated(), "float32", quantization="awq")
