"""The loader: sharded checkpoints, each role's half, dtypes, and the errors of a bad directory."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from afdserve import LLM, SamplingParams
from afdserve.config import EngineConfig
from afdserve.model.checkpoint.loader import PROGRESS_DESC, CheckpointError, load_model
from afdserve.model.fixtures.tiny import make_tiny_model, shard_checkpoint
from afdserve.model.parts import ModelParts

PROMPTS = [[5, 6, 7], list(range(40, 61)), [200] * 9, [72, 105]]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
EXPERT_DOWN = {
    "qwen3_moe": "model.layers.2.mlp.experts.3.down_proj.weight",
    "deepseek_v2": "model.layers.2.mlp.experts.3.down_proj.weight",
    "mixtral": "model.layers.2.block_sparse_moe.experts.3.w2.weight",
}


def greedy(path: Path, dtype: str = "float32") -> list[list[int]]:
    llm = LLM(str(path), dtype=dtype)
    return [out.token_ids for out in llm.generate(PROMPTS, GREEDY)]


def copy_model(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def edit_config(path: Path, **changes: object) -> None:
    config = json.loads((path / "config.json").read_text())
    config.update(changes)
    (path / "config.json").write_text(json.dumps(config))


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_sharded_checkpoint_loads_and_generates_identically(
    family: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    src = tiny_models[family]
    total = (src / "model.safetensors").stat().st_size
    sharded = shard_checkpoint(src, tmp_path / "sharded", max_shard_bytes=total // 5)
    shards = sorted(sharded.glob("*.safetensors"))
    assert len(shards) >= 3 and not (sharded / "model.safetensors").exists()
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert set(index["weight_map"].values()) == {p.name for p in shards}

    single, _ = load_model(src, ModelParts.colocated(), "float32")
    split, report = load_model(sharded, ModelParts.colocated(), "float32")
    assert not report.unexpected
    want = single.state_dict()
    for name, tensor in split.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    assert greedy(sharded) == greedy(src)


def test_progress_bar_over_shards_can_be_switched_off(
    tiny_models: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    src = tiny_models["qwen3_moe"]
    total = (src / "model.safetensors").stat().st_size
    sharded = shard_checkpoint(src, tmp_path / "sharded", max_shard_bytes=total // 3)
    shards = len(list(sharded.glob("*.safetensors")))
    single, _ = load_model(src, ModelParts.colocated(), "float32", progress=False)
    assert capsys.readouterr().err == ""
    shown, _ = load_model(sharded, ModelParts.colocated(), "float32", progress=True)
    err = capsys.readouterr().err
    assert PROGRESS_DESC in err and f"{shards}/{shards}" in err
    # The default draws only on a terminal; pytest's captured stderr is not one.
    load_model(sharded, ModelParts.colocated(), "float32")
    assert capsys.readouterr().err == ""
    want = single.state_dict()
    for name, tensor in shown.state_dict().items():
        assert torch.equal(tensor, want[name]), name
    with pytest.raises(ValueError, match="EngineConfig.use_tqdm_on_load='no'"):
        EngineConfig(model=str(src), use_tqdm_on_load="no")  # type: ignore[arg-type]


@pytest.mark.parametrize("family", sorted(EXPERT_DOWN))
def test_missing_expert_tensor_is_named(
    family: str, tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    path = copy_model(tiny_models[family], tmp_path / "model")
    missing = EXPERT_DOWN[family]
    weights = load_file(path / "model.safetensors")
    del weights[missing]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")) as err:
        load_model(path, ModelParts.colocated(), "float32")
    assert "experts.2." not in str(err.value)  # only the tensor that is actually missing
    with pytest.raises(CheckpointError, match=missing.replace(".", r"\.")):
        LLM(str(path), dtype="float32")
    # The FFN half needs it too; the attention half does not and loads.
    with pytest.raises(CheckpointError):
        load_model(path, ModelParts(attention=False, ffn=True), "float32")
    load_model(path, ModelParts(attention=True, ffn=False), "float32")


def test_unknown_family_lists_supported_ones(tiny_models: dict[str, Path], tmp_path: Path) -> None:
    path = copy_model(tiny_models["qwen3_moe"], tmp_path / "model")
    edit_config(path, model_type="llama", architectures=["LlamaForCausalLM"])
    for build in (
        lambda: load_model(path, ModelParts.colocated(), "float32"),
        lambda: LLM(str(path), dtype="float32"),
    ):
        with pytest.raises(ValueError, match="llama") as err:
            build()
        for family in ("qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral"):
            assert family in str(err.value)


def test_known_architecture_under_another_model_type_loads(
    tiny_models: dict[str, Path], tmp_path: Path
) -> None:
    # Derivatives such as Kimi-K2 keep DeepSeek-V3's architecture under their own model_type.
    path = copy_model(tiny_models["deepseek_v3"], tmp_path / "model")
    edit_config(path, model_type="kimi_k2")
    assert greedy(path) == greedy(tiny_models["deepseek_v3"])


def test_bad_dtype_names_the_field(tiny_models: dict[str, Path]) -> None:
    path = tiny_models["qwen3_moe"]
    with pytest.raises(ValueError, match=r"dtype.*'int8'.*float32"):
        load_model(path, ModelParts.colocated(), "int8")
    with pytest.raises(ValueError, match=r"dtype.*'float8'.*float32"):
        LLM(str(path), dtype="float8")


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v2"])
def test_bfloat16_loads_and_runs(family: str, tiny_models: dict[str, Path]) -> None:
    llm = LLM(str(tiny_models[family]), dtype="bfloat16")
    model = llm.engine.core_client.core.model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    outs = llm.generate(PROMPTS, GREEDY)
    reference = greedy(tiny_models[family])
    for out in outs:
        assert len(out.token_ids) == GREEDY.max_tokens
        assert all(0 <= t < model.config.vocab_size for t in out.token_ids)
    # Logits spread by several units: bf16 rounding rarely flips the first argmax.
    firsts = sum(out.token_ids[0] == want[0] for out, want in zip(outs, reference))
    assert firsts >= len(PROMPTS) - 1


def test_auto_dtype_follows_the_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "bf16", "mixtral", dtype="bfloat16")
    model, _ = load_model(path, ModelParts.colocated(), "auto")
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3", "mixtral"])
def test_each_half_loads_only_its_own_tensors(family: str, tiny_models: dict[str, Path]) -> None:
    path = tiny_models[family]
    full, full_report = load_model(path, ModelParts.colocated(), "float32")
    attn, attn_report = load_model(path, ModelParts(attention=True, ffn=False), "float32")
    ffn, ffn_report = load_model(path, ModelParts(attention=False, ffn=True), "float32")
    attn_names, ffn_names = set(attn.state_dict()), set(ffn.state_dict())

    assert not any("experts" in n or ".mlp." in n for n in attn_names)
    assert {"model.embed_tokens.weight", "lm_head.weight", "model.norm.weight"} <= attn_names
    assert not any("embed_tokens" in n or "lm_head" in n or "self_attn" in n for n in ffn_names)
    assert not any("layernorm" in n or n == "model.norm.weight" for n in ffn_names)
    assert any("experts.gate_up_proj" in n for n in ffn_names)
    assert any(n.endswith("mlp.gate.weight") for n in ffn_names)

    # Together the halves are the whole model, each tensor loaded once, with the same values.
    assert attn_names.isdisjoint(ffn_names)
    assert attn_names | ffn_names == set(full.state_dict())
    want = full.state_dict()
    for half in (attn, ffn):
        for name, tensor in half.state_dict().items():
            assert torch.equal(tensor, want[name]), name
    for report in (attn_report, ffn_report):
        assert not report.unexpected and report.skipped_other_half > 0
    assert len(attn_report.loaded) + len(ffn_report.loaded) == len(full_report.loaded)
    assert 0 < attn_report.bytes < full_report.bytes and 0 < ffn_report.bytes < full_report.bytes


def test_gate_on_attention_moves_the_router(hash_models: dict[str, Path]) -> None:
    path = hash_models["deepseek_v3"]
    attn, _ = load_model(path, ModelParts(True, False, gate_on_attention=True), "float32")
    ffn, _ = load_model(path, ModelParts(False, True, gate_on_attention=True), "float32")
    attn_names, ffn_names = set(attn.state_dict()), set(ffn.state_dict())
    gate = {n for n in attn_names if ".mlp." in n}
    assert gate and all(".mlp.gate." in n for n in gate)
    assert any(n.endswith("gate.tid2eid") for n in gate)
    assert any(n.endswith("gate.e_score_correction_bias") for n in gate)
    assert not any(".mlp.gate." in n for n in ffn_names)
