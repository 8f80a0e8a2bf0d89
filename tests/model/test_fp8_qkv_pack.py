"""FP8 q/k/v packed into one GEMM (model/layers/attention.py's pack_qkv) when each projection's
rows end on a 128-row scale block, as in every published FP8 GQA checkpoint (Qwen3-30B-A3B: 4096,
512, 512 rows): the projections become views of one FP8 matrix and one stacked scale grid, and the
model still gives transformers' tokens on the dequantized checkpoint. Rows that do not end on a
block (the tiny models) stay three GEMMs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from transformers import Qwen3MoeForCausalLM

from afdserve.kernels import ops
from afdserve.kernels.reference.fp8 import FP8_DTYPE
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.byte_tokenizer import build_byte_tokenizer
from afdserve.model.fixtures.fp8_checkpoint import quantize_checkpoint
from afdserve.model.fixtures.tiny import mlp_layer_types, tiny_config
from afdserve.model.layers.attention import GQAAttention
from afdserve.model.parts import ModelParts
from tests.model.test_fp8 import (
    PROMPTS,
    dequantized_copy,
    greedy,
    hf_model,
    teacher_forced_argmax,
)


def write_wide_heads(out: Path, dtype: torch.dtype = torch.float32) -> Path:
    """The tiny Qwen3-MoE with heads of 64 (q 256 rows, k and v 128 each) in the FP8 layout."""
    config = tiny_config("qwen3_moe")
    config.head_dim = 64
    config.num_hash_layers = 0
    config.mlp_layer_types = mlp_layer_types(config, 0)
    torch.manual_seed(3)
    model = Qwen3MoeForCausalLM(config).eval().to(dtype)
    model.save_pretrained(out, safe_serialization=True)
    raw = json.loads((out / "config.json").read_text())
    raw["num_experts"] = config.num_experts
    (out / "config.json").write_text(json.dumps(raw))
    build_byte_tokenizer(out)
    return quantize_checkpoint(out)


@pytest.fixture(scope="module")
def wide_heads(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_wide_heads(tmp_path_factory.mktemp("fp8-pack") / "wide-heads")


def test_fp8_qkv_is_packed_and_equals_three_gemms(wide_heads: Path) -> None:
    model, _ = load_model(wide_heads, ModelParts.colocated(), "float32")
    layers = [m for m in model.modules() if isinstance(m, GQAAttention)]
    assert layers
    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
    for attn in layers:
        assert attn.qkv is not None and attn.qkv.weight.dtype == FP8_DTYPE
        assert attn.qkv.weight.shape == (256 + 2 * 128, 64)
        assert attn.qkv.scale_inv.shape == (4, 1)
        # The projections are views of the packed matrix and grid: loading filled those.
        assert attn.k_proj.weight.data_ptr() == attn.qkv.weight[256:].data_ptr()
        assert attn.v_proj.weight_scale_inv.data_ptr() == attn.qkv.scale_inv[3:].data_ptr()
        packed = ops.fp8_linear(x, attn.qkv.weight, attn.qkv.scale_inv, None, attn.qkv.block)
        three = torch.cat([attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)], dim=-1)
        torch.testing.assert_close(packed, three, rtol=1e-5, atol=1e-6)


def test_packed_fp8_model_matches_transformers(wide_heads: Path, tmp_path: Path) -> None:
    hf = hf_model(dequantized_copy(wide_heads, tmp_path / "dequantized"))
    got = greedy(wide_heads)
    for prompt, tokens in zip(PROMPTS, got, strict=True):
        assert teacher_forced_argmax(hf, prompt, tokens) == tokens, prompt
    assert len({tuple(t) for t in got}) == len(PROMPTS)  # not a degenerate model


def test_projections_off_block_boundaries_stay_three(tmp_path: Path) -> None:
    from afdserve.model.fixtures.tiny import make_tiny_model

    path = make_tiny_model(tmp_path / "tiny", "qwen3_moe", quantization="fp8")
    model, _ = load_model(path, ModelParts.colocated(), "float32")
    layers = [m for m in model.modules() if isinstance(m, GQAAttention)]
    assert layers and all(m.qkv is None for m in layers)
