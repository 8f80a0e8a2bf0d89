"""What afdserve refuses of a DeepSeek-V4 checkpoint in FP8/FP4, in one line naming the tensor or
field and what is allowed, before it serves a token: a missing or misshapen scale, scales or
values of a dtype the config does not say, an unknown scale_fmt or expert_dtype."""

from __future__ import annotations

import json
import re
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from afdserve.model.checkpoint.loader import CheckpointError, load_model
from afdserve.model.families import load_model_config
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts
from afdserve.model.quantization import check_quantization

E8M0 = torch.float8_e8m0fnu
Weights = dict[str, torch.Tensor]


@pytest.fixture(scope="module")
def fp4_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("v4") / "fp4",
        "deepseek_v4",
        hash_layers=1,
        quantization="fp8",
        expert_dtype="fp4",
    )


@pytest.fixture(scope="module")
def fp8_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(
        tmp_path_factory.mktemp("v4") / "fp8", "deepseek_v4", hash_layers=1, quantization="fp8"
    )


def rewrite(
    src: Path,
    dst: Path,
    weights: Callable[[Weights], Weights] | None = None,
    config: Callable[[dict], dict] | None = None,
) -> Path:
    shutil.copytree(src, dst)
    if weights is not None:
        tensors = weights(load_file(dst / "model.safetensors"))
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    if config is not None:
        raw = config(json.loads((dst / "config.json").read_text()))
        (dst / "config.json").write_text(json.dumps(raw))
    return dst


def without(name: str) -> Callable[[Weights], Weights]:
    return lambda w: {k: v for k, v in w.items() if k != name}


def replaced(name: str, tensor: torch.Tensor) -> Callable[[Weights], Weights]:
    return lambda w: {**w, name: tensor}


def refused(path: Path, message: str) -> None:
    with pytest.raises((CheckpointError, ValueError), match=message) as err:
        load_model(path, ModelParts.colocated(), "float32")
    assert "\n" not in str(err.value)


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (without("layers.1.attn.wq_a.scale"), r"missing tensors: layers\.1\.attn\.wq_a\.scale$"),
        (
            without("layers.2.ffn.experts.3.w3.scale"),
            r"missing tensors: layers\.2\.ffn\.experts\.3\.w3\.scale$",
        ),
        (
            replaced("layers.1.attn.wq_a.scale", torch.ones(2, 1).to(E8M0)),
            r"layers\.1\.attn\.wq_a\.scale: shape \(2, 1\) .*expected \(1, 1\): one scale per "
            r"128x128 block",
        ),
        (
            replaced("layers.2.ffn.experts.3.w1.scale", torch.ones(32, 2).to(E8M0)),
            r"layers\.2\.ffn\.experts\.3\.w1\.scale: shape \(32, 2\) .*expected \(32, 1\): "
            r"one ue8m0 scale per 32 inputs",
        ),
        (
            replaced("layers.1.attn.wq_a.scale", torch.ones(1, 1, dtype=torch.bfloat16)),
            r"layers\.1\.attn\.wq_a\.scale: dtype torch\.bfloat16 for a block scale; allowed: "
            r"float8_e8m0fnu \(ue8m0\) or float32",
        ),
        (
            replaced("layers.2.ffn.experts.3.w1.scale", torch.ones(32, 1)),
            r"layers\.2\.ffn\.experts\.3\.w1\.scale: dtype torch\.float32 for an FP4 expert "
            r".*ue8m0",
        ),
        (  # a group scale of 2^18 (byte 145): past what the FP4 kernels take
            replaced(
                "layers.2.ffn.experts.3.w1.scale",
                torch.full((32, 1), 145, dtype=torch.uint8).view(E8M0),
            ),
            r"layers\.2\.ffn\.experts\.3\.w1\.scale: an FP4 group scale of 2\^18 \(ue8m0 byte "
            r"145\); afdserve's FP4 kernels take scales up to 2\^17 \(byte 144\)",
        ),
        (
            replaced("layers.2.ffn.experts.3.w1.weight", torch.zeros(32, 32)),
            r"layers\.2\.ffn\.experts\.3\.w1\.weight: dtype torch\.float32 for an FP4 expert "
            r".*packed e2m1 pairs",
        ),
        (
            replaced("layers.2.ffn.experts.3.w1.weight", torch.zeros(32, 32, dtype=torch.int8)),
            r"layers\.2\.ffn\.experts\.3\.w1\.weight: shape \(32, 32\) in the checkpoint, the "
            r"config implies \(32, 16\)",
        ),
        (
            replaced("layers.1.attn.wq_a.weight", torch.zeros(16, 32)),
            r"layers\.1\.attn\.wq_a\.weight: dtype torch\.float32 in an FP8 checkpoint, "
            r"float8_e4m3fn expected",
        ),
        (
            replaced(
                "layers.1.attn.compressor.wkv.weight", torch.zeros(32, 32).to(torch.float8_e4m3fn)
            ),
            r"layers\.1\.attn\.compressor\.wkv\.weight: torch\.float8_e4m3fn in the checkpoint, "
            r"but afdserve keeps this tensor in torch\.float32",
        ),
    ],
)
def test_broken_fp4_checkpoint_is_refused(fp4_dir: Path, tmp_path: Path, edit, message) -> None:
    refused(rewrite(fp4_dir, tmp_path / "broken", weights=edit), message)


def test_ue8m0_bytes_need_scale_fmt_ue8m0(fp4_dir: Path, tmp_path: Path) -> None:
    def plain_scales(raw: dict) -> dict:
        raw["quantization_config"].pop("scale_fmt")
        return raw

    refused(
        rewrite(fp4_dir, tmp_path / "m", config=plain_scales),
        r"layers\.\d+\.\S+\.scale: dtype torch\.float8_e8m0fnu \(ue8m0 scale bytes\) but "
        r"quantization_config\.scale_fmt=None; allowed: float32 scales, or ue8m0 bytes with "
        r"scale_fmt='ue8m0'",
    )


@pytest.mark.parametrize(
    ("edit", "message", "frontend"),
    [
        (
            lambda raw: {
                **raw,
                "quantization_config": {**raw["quantization_config"], "scale_fmt": "e5m2"},
            },
            r"quantization_config\.scale_fmt='e5m2' is not supported: one of \(None, 'ue8m0'\)",
            True,
        ),
        (
            lambda raw: {**raw, "expert_dtype": "nvfp4"},
            r"quantization_config\.expert_dtype='nvfp4' is not supported: one of \('fp8', 'fp4'\)",
            True,
        ),
        (
            lambda raw: {
                **raw,
                "quantization_config": {**raw["quantization_config"], "expert_dtype": "int4"},
            },
            r"quantization_config\.expert_dtype='int4' is not supported",
            True,
        ),
        # The frontend reads quantization_config alone; the model's shapes are the config's check.
        (
            lambda raw: {**raw, "moe_intermediate_size": 48},
            r"expert_dtype='fp4' with hidden_size=32, moe_intermediate_size=48: both must be "
            r"multiples of 32",
            False,
        ),
    ],
)
def test_unknown_precision_in_config_is_refused(
    fp4_dir: Path, tmp_path: Path, edit, message: str, frontend: bool
) -> None:
    path = rewrite(fp4_dir, tmp_path / "m", config=edit)
    with pytest.raises(ValueError, match=message) as err:
        load_model_config(path)
    assert "\n" not in str(err.value)
    if frontend:  # before any rank starts
        with pytest.raises(ValueError, match=message):
            check_quantization(path, None)


def test_experts_disagreeing_with_expert_dtype_are_refused(
    fp4_dir: Path, fp8_dir: Path, tmp_path: Path
) -> None:
    def fp8_experts(raw: dict) -> dict:
        del raw["expert_dtype"]
        return raw

    def fp4_experts(raw: dict) -> dict:
        return {**raw, "expert_dtype": "fp4", "moe_intermediate_size": 32}

    def no_scales(w: Weights) -> Weights:  # the experts' values alone
        return {k: v for k, v in w.items() if not (".experts." in k and k.endswith(".scale"))}

    refused(
        rewrite(fp4_dir, tmp_path / "a", config=fp8_experts),
        r"layers\.0\.ffn\.experts\.0\.w1\.scale: shape \(32, 1\), an FP4 expert's scales "
        r".* in a checkpoint whose config\.json does not say expert_dtype='fp4'",
    )
    refused(
        rewrite(fp4_dir, tmp_path / "b", weights=no_scales, config=fp8_experts),
        r"layers\.0\.ffn\.experts\.0\.w1\.weight: dtype torch\.int8 \(FP4-packed "
        r"experts\) in a checkpoint whose config\.json does not say expert_dtype='fp4'",
    )
    refused(
        rewrite(fp8_dir, tmp_path / "c", config=fp4_experts),
        r"layers\.0\.ffn\.experts\.0\.w1\.scale: shape \(1, 1\) in the checkpoint, "
        r"expected \(32, 1\): one ue8m0 scale per 32 inputs",
    )
    refused(
        rewrite(fp8_dir, tmp_path / "d", weights=no_scales, config=fp4_experts),
        r"layers\.0\.ffn\.experts\.0\.w1\.weight: dtype torch\.float8_e4m3fn for an FP4 "
        r"expert \(expert_dtype='fp4'\); expected packed e2m1 pairs",
    )


def test_fp4_experts_are_deepseek_v4_only(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    from afdserve.model.fixtures.fp8_checkpoint import quantize_checkpoint

    path = quantize_checkpoint(shutil.copytree(tiny_models["qwen3_moe"], tmp_path / "qwen"))
    raw = json.loads((path / "config.json").read_text())
    raw["quantization_config"]["expert_dtype"] = "fp4"
    (path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(
        ValueError,
        match=re.escape(
            "quantization_config.expert_dtype='fp4' for model_type='qwen3_moe': FP4 experts "
            "are read for deepseek_v4 only"
        ),
    ):
        check_quantization(path, None)


def test_online_fp8_of_a_plain_v4_is_refused(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "plain", "deepseek_v4", hash_layers=1)
    with pytest.raises(
        ValueError,
        match=r"quantization='fp8' on a deepseek_v4 checkpoint "
        r"without quantization_config is not supported.*allowed: None$",
    ):
        load_model(path, ModelParts.colocated(), "float32", quantization="fp8")
