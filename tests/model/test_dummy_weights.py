"""load_format="dummy": a model built from config.json alone, with random weights that depend on
the seed and each tensor's name only, so every half of every topology holds the colocated
model's values; and the preset config.json that makes such a model directory."""

from __future__ import annotations

import json

import pytest
import torch

from afdserve.model.checkpoint.loader import CheckpointError, load_model
from afdserve.model.parts import ModelParts
from afdserve.model.presets import preset_hf_config, write_preset_config


def _state(model) -> dict[str, torch.Tensor]:
    return {name: t.detach().clone() for name, t in model.state_dict().items()}


@pytest.mark.parametrize("family", ["deepseek_v3", "qwen3_moe"])
@pytest.mark.parametrize("gate", [False, True])
def test_halves_and_shards_hold_the_colocated_values(hash_models, family, gate):
    """deepseek_v3 has a correction bias, shared experts and a dense first layer; both families
    have hash-routed layers (tid2eid)."""
    model_dir = hash_models[family]
    full = _state(
        load_model(model_dir, ModelParts.colocated(gate), "float32", load_format="dummy", seed=7)[0]
    )
    attention = _state(
        load_model(
            model_dir, ModelParts(True, False, gate), "float32", load_format="dummy", seed=7
        )[0]
    )
    ffn = _state(
        load_model(
            model_dir, ModelParts(False, True, gate), "float32", load_format="dummy", seed=7
        )[0]
    )
    assert set(attention) | set(ffn) == set(full)
    for half in (attention, ffn):
        for name, tensor in half.items():
            assert torch.equal(tensor, full[name]), name
    experts = (3, 1)  # a shard in a non-sorted order: values follow the global expert id
    shard = _state(
        load_model(
            model_dir,
            ModelParts(False, True, gate, experts=experts),
            "float32",
            load_format="dummy",
            seed=7,
        )[0]
    )
    stacked = [n for n in shard if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]
    assert stacked
    for name, tensor in shard.items():
        want = full[name][list(experts)] if name in stacked else full[name]
        assert torch.equal(tensor, want), name
    other = _state(
        load_model(model_dir, ModelParts.colocated(gate), "float32", load_format="dummy", seed=8)[0]
    )
    random = [n for n in full if not n.endswith("norm.weight")]
    assert all(not torch.equal(other[n], full[n]) for n in random)


def test_dummy_weights_are_not_the_checkpoint(tiny_models):
    real = _state(load_model(tiny_models["qwen3_moe"], ModelParts.colocated(), "float32")[0])
    dummy = _state(
        load_model(
            tiny_models["qwen3_moe"], ModelParts.colocated(), "float32", load_format="dummy"
        )[0]
    )
    name = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.equal(real[name], dummy[name])
    assert abs(dummy[name].std().item() - 0.02) < 0.002


def test_dummy_reads_no_safetensors(tmp_path):
    """A corrupt shard beside config.json: dummy never opens it, auto does and fails."""
    write_preset_config("tiny", tmp_path / "m")
    (tmp_path / "m" / "model.safetensors").write_bytes(b"not a safetensors file")
    model, report = load_model(
        tmp_path / "m", ModelParts.colocated(), "float32", load_format="dummy"
    )
    assert report.loaded == [] and report.bytes > 0
    assert model.config.num_layers == preset_hf_config("tiny")["num_hidden_layers"]
    with pytest.raises(Exception):  # noqa: B017 (safetensors' own error type)
        load_model(tmp_path / "m", ModelParts.colocated(), "float32")
    write_preset_config("tiny", tmp_path / "empty")
    with pytest.raises(CheckpointError, match="no \\*.safetensors"):
        load_model(tmp_path / "empty", ModelParts.colocated(), "float32", load_format="auto")
    with pytest.raises(ValueError, match="load_format='npz'.*'auto', 'safetensors', 'dummy'"):
        load_model(tmp_path / "empty", ModelParts.colocated(), "float32", load_format="npz")


def test_write_preset_config(tmp_path):
    out = write_preset_config("qwen3-30b-a3b", tmp_path / "q")
    assert json.loads((out / "config.json").read_text()) == preset_hf_config("qwen3-30b-a3b")
    assert sorted(p.name for p in out.iterdir()) == ["config.json"]
    assert write_preset_config("qwen3-30b-a3b", out) == out  # the same config again: kept
    with pytest.raises(FileExistsError, match="not this preset's config.json alone"):
        write_preset_config("tiny", out)
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "x.txt").write_text("x")
    with pytest.raises(FileExistsError):
        write_preset_config("tiny", tmp_path / "other")
    with pytest.raises(ValueError, match="preset='nope' is not known"):
        write_preset_config("nope", tmp_path / "n")
