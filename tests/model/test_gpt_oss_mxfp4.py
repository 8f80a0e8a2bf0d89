"""gpt-oss's public MXFP4 expert checkpoint (quant_method 'mxfp4': `..._blocks` e2m1 pairs and
`..._scales` ue8m0 bytes per 32 inputs), read as published and kept FP4 in memory, against
transformers' GptOssForCausalLM holding the experts transformers' own MXFP4 dequantization
(`convert_moe_packed_tensors`) makes of the same bytes: prefill logits and greedy tokens,
teacher-forced. The checkpoint's tensors are refused by name where the config disagrees."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from afdserve.model.checkpoint.loader import load_model
from afdserve.model.families.gpt_oss.quant import GptOssFp4Experts
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts

from .test_gpt_oss import greedy, teacher_forced
from .test_parity import PROMPTS, afdserve_prefill_logits, hf_logits, relative_close


@pytest.fixture(scope="module")
def dirs(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gpt-oss-mxfp4")
    plain = make_tiny_model(root / "plain", "gpt_oss", seed=1)
    return plain, make_tiny_model(root / "mxfp4", "gpt_oss", seed=1, quantization="mxfp4")


@pytest.fixture(scope="module")
def hf_dequantized(dirs: tuple[Path, Path]) -> torch.nn.Module:
    """transformers' model of the same seed with its experts as transformers dequantizes the
    MXFP4 checkpoint's bytes."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    plain, mxfp4 = dirs
    model = AutoModelForCausalLM.from_pretrained(
        plain, dtype=torch.float32, attn_implementation="eager"
    ).eval()
    stored = load_file(mxfp4 / "model.safetensors")
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in [n for n in stored if n.endswith("_blocks")]:
            stem = name.removesuffix("_blocks")
            weight = convert_moe_packed_tensors(
                stored[name], stored[stem + "_scales"], dtype=torch.float32
            )
            assert not torch.equal(weight, params[stem])  # FP4 rounding changed something
            params[stem].copy_(weight)
    return model


def test_experts_stay_fp4(dirs) -> None:
    model = load_model(dirs[1], ModelParts.colocated(), "float32")[0]
    experts = model.model.layers[0].mlp.experts
    assert isinstance(experts, GptOssFp4Experts)
    assert experts.gate_up_proj.dtype == torch.uint8 and experts.gate_up_proj.shape == (4, 128, 32)
    assert experts.down_proj_scale_inv.shape == (4, 64, 2)


def test_mxfp4_logits_and_tokens_match_transformers(dirs, hf_dequantized) -> None:
    model = load_model(dirs[1], ModelParts.colocated(), "float32")[0]
    for prompt, logits in zip(PROMPTS, afdserve_prefill_logits(model, PROMPTS), strict=True):
        relative_close(logits, hf_logits(hf_dequantized, prompt))
    tokens = greedy(dirs[1])
    for prompt, got in zip(PROMPTS, tokens, strict=True):
        assert got == teacher_forced(hf_dequantized, prompt, got), prompt
    assert tokens != greedy(dirs[0])  # the FP4 rounding shows: the two checkpoints differ


def test_unquantized_experts_under_an_mxfp4_config_are_refused(dirs, tmp_path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(dirs[0], copy)
    config = json.loads((copy / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "mxfp4"}
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match=r"experts\.(down|gate_up)_proj: dtype torch.float32"):
        load_model(copy, ModelParts.colocated(), "float32")


def test_mxfp4_bytes_under_a_plain_config_are_refused(dirs, tmp_path) -> None:
    copy = tmp_path / "m"
    shutil.copytree(dirs[1], copy)
    config = json.loads((copy / "config.json").read_text())
    del config["quantization_config"]
    (copy / "config.json").write_text(json.dumps(config))
    with pytest.raises(ValueError, match="uint8 \\(MXFP4 bytes\\)"):
        load_model(copy, ModelParts.colocated(), "float32")


def test_fp8_option_on_mxfp4_is_refused(dirs) -> None:
    with pytest.raises(ValueError, match="quantization='fp8' on an MXFP4 checkpoint"):
        load_model(dirs[1], ModelParts.colocated(), "float32", quantization="fp8")


def test_group_scale_past_the_fp4_kernels_is_refused(dirs, tmp_path) -> None:
    """A ue8m0 group scale above 2^17 (byte 144), which the FP4 kernels' bf16 decode cannot
    hold, is refused when it loads, naming the tensor and the largest allowed."""
    from safetensors.torch import load_file, save_file

    copy = tmp_path / "m"
    shutil.copytree(dirs[1], copy)
    tensors = load_file(copy / "model.safetensors")
    name = next(n for n in tensors if n.endswith("down_proj_scales"))
    tensors[name] = tensors[name].clone()
    tensors[name].view(-1)[3] = 200
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(
        ValueError, match=rf"{name}: an FP4 group scale of 2\^73 \(ue8m0 byte 200\)"
    ):
        load_model(copy, ModelParts.colocated(), "float32")
