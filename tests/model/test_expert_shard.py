"""Expert-parallel shards of the FFN half: a shard loads only its experts (per-expert or stacked
checkpoints), and the shards' routed outputs add up to the whole half's, with routing id -1
meaning "no expert"."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from afdserve.kernels.reference import layers as reference
from afdserve.layout.experts import contiguous_placement
from afdserve.model.checkpoint.loader import load_model
from afdserve.model.parts import ModelParts

FFN = ModelParts(attention=False, ffn=True)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral"])
def test_shards_add_up_to_the_whole_half(family: str, hash_models: dict[str, Path]) -> None:
    path = hash_models[family]
    full, _ = load_model(path, FFN, "float32")
    config = full.config
    placement = ((5, 0, 2), (1, 7), (3, 4, 6))  # not contiguous, uneven
    shards = [
        load_model(path, ModelParts(False, True, experts=held), "float32") for held in placement
    ]
    for (shard, report), held in zip(shards, placement, strict=True):
        assert report.skipped_other_half > 0
        for name, tensor in shard.state_dict().items():
            want = full.state_dict()[name]
            assert torch.equal(tensor, want[list(held)] if ".mlp.experts." in name else want), name
    torch.manual_seed(0)
    x = torch.randn(9, config.hidden_size)
    ids = torch.randint(0, config.vocab_size, (9,))
    ids[-2:] = -1  # pad rows
    for layer, kind in enumerate(config.layer_types):
        want = full.ffn_half(layer, x, ids)
        if kind == "dense":
            got = shards[0][0].ffn_half(layer, x, ids)
        else:
            blocks = [shard.model.layers[layer].mlp for shard, _ in shards]
            routing = blocks[0].gate(x, ids)
            got = sum(block.experts(x, routing) for block in blocks)
            if blocks[0].shared_experts is not None:
                got = got + blocks[0].shared_experts(x)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


def test_stacked_checkpoints_slice_the_shard(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    src = tiny_models["qwen3_moe"]
    full, _ = load_model(src, FFN, "float32")
    stacked = {name: t for name, t in full.state_dict().items()}
    attention = {k: v for k, v in load_file(src / "model.safetensors").items() if ".mlp." not in k}
    tmp_path.mkdir(exist_ok=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json"):
        if (src / name).exists():
            (tmp_path / name).write_bytes((src / name).read_bytes())
    save_file(
        {**attention, **{k: v.contiguous() for k, v in stacked.items()}},
        tmp_path / "model.safetensors",
    )
    held = contiguous_placement(full.config.num_experts, 3)[1]
    shard, report = load_model(tmp_path, ModelParts(False, True, experts=held), "float32")
    for name, tensor in shard.state_dict().items():
        want = stacked[name]
        assert torch.equal(tensor, want[list(held)] if ".mlp.experts." in name else want), name


def test_reference_experts_skip_id_minus_one() -> None:
    torch.manual_seed(1)
    x = torch.randn(4, 8)
    gate_up, down = torch.randn(3, 12, 8), torch.randn(3, 8, 6)
    ids = torch.tensor([[0, 2], [1, -1], [-1, -1], [2, 1]])
    weights = torch.rand(4, 2)
    kept = weights.masked_fill(ids < 0, 0.0)
    want = reference.moe_experts(x, ids.clamp(min=0), kept, gate_up, down)
    got = reference.moe_experts(x, ids, weights, gate_up, down)
    torch.testing.assert_close(got, want)
    assert torch.equal(got[2], torch.zeros(8))
    dense = reference.moe_experts_dense(x, ids, weights, gate_up, down)
    torch.testing.assert_close(dense, want)
