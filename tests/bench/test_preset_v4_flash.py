"""The `deepseek-v4-flash` preset: its config builds DeepSeek-V4-Flash's model (284B parameters,
13B active, as its model card says), `NAME:LAYERS` keeps the first layers everywhere a preset is
named, and the bytes a decode step reads (bench/bytes.py) count its FP8 and FP4 weights as a
hand count from the published dimensions does. All on the meta device: no weights."""

from __future__ import annotations

import json
from math import ceil
from pathlib import Path

import pytest
import torch

from afdserve.bench.bytes import step_weight_bytes
from afdserve.bench.decode import DecodeBench
from afdserve.cli import main
from afdserve.model.checkpoint.loader import build_model
from afdserve.model.families import parse_model_config
from afdserve.model.families.deepseek_v4.quant import Fp4Experts
from afdserve.model.layers.fp8 import Fp8Linear
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_config, preset_hf_config, write_preset_config

FLASH = "deepseek-v4-flash"


def meta_model(name: str) -> torch.nn.Module:
    return build_model(preset_config(name), ModelParts.colocated(), torch.bfloat16, "meta")


def test_preset_builds_flash_at_its_published_size() -> None:
    c = preset_config(FLASH)
    assert (c.num_layers, c.hidden_size, c.num_experts, c.top_k) == (43, 4096, 256, 6)
    assert c.family_config.attention_types[:4] == (
        "sliding_attention",
        "sliding_attention",
        "compressed_sparse_attention",
        "heavily_compressed_attention",
    )
    assert c.family_config.attention_types[-1] == "compressed_sparse_attention"
    assert c.layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
    assert c.quantization.expert_dtype == "fp4" and c.quantization.scale_fmt == "ue8m0"
    # YaRN (rope_scaling) on the compressed layers' rope only, as transformers reads it.
    raw = {k: v for k, v in preset_hf_config(FLASH).items() if k != "rope_scaling"}
    unscaled = parse_model_config(raw)
    assert c.family_config.compress_inv_freq != unscaled.family_config.compress_inv_freq
    assert c.rope_inv_freq == unscaled.rope_inv_freq
    total = expert = 0
    for name, p in meta_model(FLASH).named_parameters():
        if name.endswith("_scale_inv"):
            continue
        count = p.numel() * (2 if isinstance(p, torch.Tensor) and p.dtype == torch.uint8 else 1)
        total += count
        expert += count if name.endswith(("experts.gate_up_proj", "experts.down_proj")) else 0
    embeddings = 2 * c.vocab_size * c.hidden_size  # embed and head, which 13B leaves out
    assert abs(total / 284e9 - 1) < 0.01
    assert abs((total - expert + expert * 6 / 256 - embeddings) / 13e9 - 1) < 0.05


def test_layers_suffix_keeps_the_first_layers(tmp_path: Path) -> None:
    raw = preset_hf_config(f"{FLASH}:4")
    assert raw == {**preset_hf_config(FLASH), "num_hidden_layers": 4}
    c = preset_config(f"{FLASH}:4")
    assert c.num_layers == 4 and len(c.family_config.attention_types) == len(c.layer_types) == 4
    assert c.family_config.attention_types == preset_config(FLASH).family_config.attention_types[:4]
    model = meta_model(f"{FLASH}:4")
    assert len(model.model.layers) == 4
    assert isinstance(model.model.layers[3].mlp.experts, Fp4Experts)
    assert isinstance(model.model.layers[3].self_attn.q_b_proj, Fp8Linear)
    out = write_preset_config(f"{FLASH}:2", tmp_path / "two")
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert main(["make-config", "--preset", f"{FLASH}:3", str(tmp_path / "three")]) == 0
    assert json.loads((tmp_path / "three" / "config.json").read_text())["num_hidden_layers"] == 3
    bench = DecodeBench(
        model_dir=None, preset=f"{FLASH}:4", random_weights=True, batch_sizes=(1,), context_len=8
    )
    assert bench.preset == f"{FLASH}:4"


@pytest.mark.parametrize(
    ("name", "message"),
    [
        (f"{FLASH}:0", r"must be an integer in \[1, 43\]"),
        (f"{FLASH}:44", r"must be an integer in \[1, 43\]"),
        (f"{FLASH}:four", r"must be an integer in \[1, 43\]"),
        ("deepseek-v5:4", r"preset='deepseek-v5:4' is not known: one of \["),
    ],
)
def test_bad_preset_names_are_refused(name: str, message: str) -> None:
    with pytest.raises(ValueError, match=message) as err:
        preset_hf_config(name)
    assert "\n" not in str(err.value)
    with pytest.raises(ValueError, match="bench.preset="):
        DecodeBench(
            model_dir=None, preset=name, random_weights=True, batch_sizes=(1,), context_len=8
        )


def fp8(rows: int, cols: int) -> int:
    """An FP8 weight in memory: a byte per value, a float32 scale per 128 x 128 block."""
    return rows * cols + 4 * ceil(rows / 128) * ceil(cols / 128)


def fp4_expert(hidden: int, inter: int) -> int:
    """One FP4 expert: half a byte per value, a ue8m0 byte per 32 inputs (gate, up, down)."""
    values = 3 * hidden * inter
    return values // 2 + values // 32


def test_step_bytes_count_fp8_and_fp4_by_hand() -> None:
    """Flash's first 4 layers (sliding, sliding, CSA, HCA), batch 8, by its published sizes."""
    h, heads, dim, q_rank, o_rank, groups = 4096, 64, 512, 1024, 1024, 8
    inter, vocab, n, index_dim, index_heads = 2048, 129280, 4, 128, 64
    bf16, f32 = 2, 4
    projections = (
        fp8(q_rank, h)
        + fp8(heads * dim, q_rank)
        + fp8(dim, h)
        + fp8(groups * o_rank, heads * dim // groups)
        + fp8(h, groups * o_rank)
    )
    norms = f32 * (q_rank + dim + heads + 2 * h)  # q/kv norms, sinks, the two layer norms
    mhc = 2 * f32 * ((2 + n) * n * (n * h + 1) + 3)  # attn_hc and ffn_hc: fn, base, scale
    attention = projections + norms + mhc

    def compressor(width: int, rate: int, norm: int) -> int:  # kv, gate, position bias, norm
        return 2 * bf16 * width * h + f32 * (rate * width + norm)

    indexer = compressor(2 * index_dim, 4, index_dim) + fp8(index_heads * index_dim, q_rank)
    csa = compressor(2 * dim, 4, dim) + indexer + bf16 * index_heads * h  # + weights_proj
    hca = compressor(dim, 128, dim)
    ffn = bf16 * 256 * h + 2 * fp8(inter, h) + fp8(h, inter)  # router, shared expert
    hit = {f"model.layers.{i}.mlp.experts": 10 + i for i in range(4)}
    experts = fp4_expert(h, inter) * sum(hit.values())
    head = bf16 * vocab * h + f32 * (n * n * h + n + 1) + f32 * h  # lm_head, hc_head, norm
    embed_rows = 8 * bf16 * h
    want = 4 * (attention + ffn) + csa + hca + experts + head + embed_rows
    model = meta_model(f"{FLASH}:4")
    assert step_weight_bytes(model, model, 8, hit) == want
    # 4.25 bits per expert weight (4 + 8 / 32): 0.27x of bf16's bytes.
    assert fp4_expert(h, inter) / (3 * h * inter * bf16) == 4.25 / 16
