"""CPU smoke of `afdserve bench decode` with the `tiny` preset: the whole path runs and the byte
accounting matches a count made by hand."""

from __future__ import annotations

import argparse

import pytest
import torch

from afdserve.bench.cli import add_bench_parser
from afdserve.bench.decode import (
    DecodeBench,
    main_decode,
    run_decode_bench,
    step_kv_bytes,
)
from afdserve.model.presets import preset_config


def spec(**overrides) -> DecodeBench:
    fields = dict(
        model_dir=None,
        preset="tiny",
        random_weights=True,
        batch_sizes=(1, 3),
        context_len=20,
        steps=3,
        dtype="float32",
        device="cpu",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


@pytest.mark.parametrize("topology,ubatches", [("colocated", 1), ("in-process", 2)])
def test_decode_bench_runs_on_cpu(topology, ubatches):
    results, hf = run_decode_bench(spec(topology=topology, ubatches=ubatches))
    assert hf is None
    assert [r.batch for r in results] == [1, 3]
    assert all(r.step_ms > 0 and r.tokens_per_s > 0 and r.copy_gbps is None for r in results)
    c = preset_config("tiny")
    h, hd, f32 = c.hidden_size, c.head_dim, 4
    attention = h * hd * (2 * c.num_heads + 2 * c.num_kv_heads) + 2 * hd + 2 * h
    router = c.num_experts * h
    expert = 3 * h * c.moe_intermediate_size
    lm_head, final_norm, embed_row = c.vocab_size * h, h, h
    # One sequence touches exactly top_k distinct experts per layer.
    dense = c.num_layers * (attention + router) + lm_head + final_norm + embed_row
    one, three = results
    assert one.weight_bytes == (dense + c.num_layers * c.top_k * expert) * f32
    assert one.weight_bytes < three.weight_bytes
    assert three.weight_bytes <= (dense + 2 * embed_row + c.num_layers * 3 * c.top_k * expert) * f32
    mean_context = 20 + 3 + (3 + 1) / 2  # warm-up steps, then the timed steps
    per_token = c.num_layers * 2 * c.num_kv_heads * hd * f32
    assert one.kv_bytes == int(mean_context * per_token)
    assert three.kv_bytes == int(3 * mean_context * per_token)


def test_kv_bytes_of_mla_count_one_latent():
    from afdserve.model.checkpoint.loader import build_model
    from afdserve.model.families import parse_model_config
    from afdserve.model.parts import ModelParts
    from afdserve.model.presets import preset_hf_config

    raw = preset_hf_config("deepseek-v2-lite")
    raw["num_hidden_layers"] = 2
    c = parse_model_config(raw)
    model = build_model(c, ModelParts.colocated(), torch.bfloat16, "meta")
    assert step_kv_bytes(model, 4, 10.0, 2) == 4 * 10 * 2 * (512 + 64) * 2


def test_cli_prints_a_table(capsys):
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        "bench decode --preset tiny --random-weights --batch-sizes 2 --context-len 9 --steps 2 "
        "--dtype float32 --device cpu".split()
    )
    assert main_decode(args) == 0
    out = capsys.readouterr().out
    assert "tokens/s" in out and "\n    2 " in out


@pytest.mark.parametrize(
    "field,value",
    [
        ("preset", "nope"),
        ("random_weights", False),
        ("batch_sizes", ()),
        ("steps", 1),
        ("topology", "2A1F"),
        ("graph_mode", "full"),
    ],
)
def test_bad_settings_name_the_field(field, value):
    with pytest.raises(ValueError, match=f"bench.{field}"):
        spec(**{field: value})
