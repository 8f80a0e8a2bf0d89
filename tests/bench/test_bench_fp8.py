"""`afdserve bench decode` with FP8 weights and the FP8 KV cache on CPU: the flags reach the model
and the cache, and the bytes a step must read match a count made by hand from the config (one
byte per FP8 weight plus a float32 scale per 128 x 128 block, partial blocks included; one byte
per cached element)."""

from __future__ import annotations

import argparse
import json
from math import ceil
from pathlib import Path

import pytest
import torch

from afdserve.bench.cli import add_bench_parser
from afdserve.bench.decode import DecodeBench, main_decode, run_decode_bench
from afdserve.model.presets import preset_hf_config

# Wider than the tiny preset so that grids have several blocks, some partial (192 = 1.5 blocks).
WIDE = dict(
    hidden_size=256,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=64,
    moe_intermediate_size=192,
    num_hidden_layers=2,
    num_experts=8,
    num_local_experts=8,
    num_experts_per_tok=2,
    vocab_size=512,
    torch_dtype="float32",
)


@pytest.fixture(scope="module")
def wide_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    config = preset_hf_config("tiny")
    config.update(WIDE)
    out = tmp_path_factory.mktemp("bench-fp8") / "wide"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(config))
    return out


def fp8_bytes(rows: int, cols: int) -> int:
    """A block-scaled FP8 [rows, cols] weight: a byte per element, a float32 per 128x128 block."""
    return rows * cols + 4 * ceil(rows / 128) * ceil(cols / 128)


def spec(model_dir: Path, **overrides) -> DecodeBench:
    fields = dict(
        model_dir=str(model_dir),
        preset=None,
        random_weights=True,
        batch_sizes=(1,),
        context_len=20,
        steps=3,
        dtype="float32",
        device="cpu",
        quantization="fp8",
        kv_cache_dtype="fp8",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


def test_fp8_weights_and_kv_bytes_match_a_hand_count(wide_dir: Path):
    (one,), _ = run_decode_bench(spec(wide_dir))
    (plain,), _ = run_decode_bench(spec(wide_dir, quantization=None, kv_cache_dtype="auto"))
    h, hd, heads, kv = 256, 64, 4, 2
    inter, experts, top_k, layers, vocab, f32 = 192, 8, 2, 2, 512, 4
    # q, k, v, o in FP8; the q/k norms and the layer norms in float32.
    projections = fp8_bytes(heads * hd, h) + 2 * fp8_bytes(kv * hd, h) + fp8_bytes(h, heads * hd)
    attention = projections + (2 * hd + 2 * h) * f32
    router = experts * h * f32
    # gate_up [2I, H]: a grid per half (I = 1.5 blocks: the halves do not meet on a boundary).
    expert = 2 * inter * h + 4 * 2 * ceil(inter / 128) * ceil(h / 128) + fp8_bytes(h, inter)
    lm_head, final_norm, embed_row = vocab * h * f32, h * f32, h * f32
    dense = layers * (attention + router) + lm_head + final_norm + embed_row
    # One sequence touches exactly top_k distinct experts per layer.
    assert one.weight_bytes == dense + layers * top_k * expert
    mean_context = 20 + 3 + (3 + 1) / 2  # warm-up steps, then the timed steps
    assert one.kv_bytes == int(mean_context * layers * 2 * kv * hd * 1)
    assert plain.kv_bytes == 4 * one.kv_bytes  # a float32 cache
    bf16_experts = layers * top_k * 3 * inter * h * f32
    assert plain.weight_bytes - one.weight_bytes > 0.7 * bf16_experts


def test_cli_takes_quantization_and_kv_cache_dtype(wide_dir: Path, capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        f"bench decode --model {wide_dir} --random-weights --batch-sizes 2 --context-len 9 "
        "--steps 2 --dtype float32 --device cpu --quantization fp8 --kv-cache-dtype fp8".split()
    )
    assert (args.quantization, args.kv_cache_dtype) == ("fp8", "fp8")
    assert main_decode(args) == 0
    out = capsys.readouterr().out
    assert "fp8 weights, fp8 KV cache" in out and "\n    2 " in out


@pytest.mark.parametrize(
    "field,value", [("quantization", "int4"), ("kv_cache_dtype", "fp16"), ("compare_hf", True)]
)
def test_bad_fp8_settings_name_the_field(wide_dir: Path, field, value):
    with pytest.raises(ValueError, match=f"bench.{field}"):
        spec(wide_dir, **{field: value})


def test_fp8_model_holds_fp8_weights_and_cache(wide_dir: Path):
    """What the bench counted is what it ran: FP8 stacks and an FP8 cache."""
    from afdserve.bench.decode_steps import DecodeSteps, build_halves
    from afdserve.model.config import read_hf_config

    s = spec(wide_dir)
    model, _ = build_halves(s, read_hf_config(str(wide_dir)))
    experts = model.model.layers[0].mlp.experts
    assert experts.gate_up_proj.dtype == torch.float8_e4m3fn
    assert experts.gate_up_proj_scale_inv.shape == (8, 4, 2)
    steps = DecodeSteps(model, model, s, 1)
    assert steps.kv.dtype == torch.float8_e4m3fn
    assert torch.isfinite(steps.kv.layers[0][0].float()).all()


def test_fp8_a2e_rows_reach_the_boundary_and_in_process_equals_colocated(wide_dir: Path):
    """--a2e-dtype fp8: the in-process connector hands quantized rows to the FFN half, and its
    greedy tokens equal the colocated model's under the same setting (which runs the same
    quantize-dequantize at its FFN boundary), step by step."""
    from afdserve.bench.decode_steps import DecodeSteps, build_halves
    from afdserve.model.config import read_hf_config

    raw = read_hf_config(str(wide_dir))
    tokens = {}
    for topology in ("colocated", "in-process"):
        s = spec(
            wide_dir,
            topology=topology,
            a2e_dtype="fp8",
            quantization=None,
            kv_cache_dtype="auto",
            batch_sizes=(3,),
        )
        attn, ffn = build_halves(s, raw)
        steps = DecodeSteps(attn, ffn, s, 3)
        assert steps.eager.boundary.a2e.name == "fp8"
        tokens[topology] = [steps.step()[0].tolist() for _ in range(4)]
    assert tokens["in-process"] == tokens["colocated"]


def test_a2e_dtype_is_checked_by_name(wide_dir: Path):
    with pytest.raises(ValueError, match="bench.a2e_dtype"):
        spec(wide_dir, a2e_dtype="int8")
    with pytest.raises(ValueError, match="bench.a2e_dtype"):
        spec(wide_dir, a2e_dtype="fp8", topology="1A1F", connector="ipc")
