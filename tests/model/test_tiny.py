"""The tiny checkpoints load back into transformers unchanged and are fit to be an oracle."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from afdserve.model.fixtures.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from afdserve.model.fixtures.tiny import (
    FAMILIES,
    build_tiny_model,
    gate_prefix,
    make_tiny_model,
    shard_checkpoint,
)

TEXT = "héllo wörld ✓ 你好\n\ttabs, \x00 nul and emoji 🙂"
EXPERTS = 8


@pytest.fixture(autouse=True, scope="module")
def one_thread() -> Iterator[None]:
    # Tensors this small gain nothing from intra-op threads, and on a busy 2-core machine the
    # thread pool's contention made a 0.1 s decode loop take 25 s.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny")
    return {family: make_tiny_model(root / family, family) for family in FAMILIES}


def _random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    return torch.randint(
        0, VOCAB_SIZE, (batch, length), generator=torch.Generator().manual_seed(seed)
    )


def _load(path: Path, hash_tables: int = 0) -> torch.nn.Module:
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True)
    assert not info["missing_keys"] and not info["mismatched_keys"], info
    # transformers has no use for the hash tables (it may report them under its own renaming).
    unexpected = info["unexpected_keys"]
    assert len(unexpected) == hash_tables and all(k.endswith(".tid2eid") for k in unexpected)
    return model.eval()


def _weight_names(path: Path) -> set[str]:
    with safe_open(path / "model.safetensors", "pt") as f:
        return set(f.keys())


@pytest.mark.parametrize("family", FAMILIES)
def test_config_describes_family(checkpoints: dict[str, Path], family: str) -> None:
    config = AutoConfig.from_pretrained(checkpoints[family])
    assert config.model_type == family
    assert config.vocab_size == VOCAB_SIZE
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    assert config.num_hash_layers == 0
    model, _ = build_tiny_model(family)
    declared = [
        "dense" if not hasattr(layer.mlp, "experts") else "moe" for layer in model.model.layers
    ]
    assert config.mlp_layer_types == declared
    assert "dense" in declared or family == "mixtral"
    generation = GenerationConfig.from_pretrained(checkpoints[family])
    assert generation.do_sample is False and generation.eos_token_id == EOS_ID
    raw = json.loads((checkpoints[family] / "config.json").read_text())
    assert "rope_scaling" not in raw or raw["rope_scaling"] is None
    assert raw["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000.0}
    size = sum(p.stat().st_size for p in checkpoints[family].iterdir())
    assert size <= 5 * 1024 * 1024


@pytest.mark.parametrize("family", FAMILIES)
def test_experts_are_stored_per_expert(checkpoints: dict[str, Path], family: str) -> None:
    names = _weight_names(checkpoints[family])
    if family == "mixtral":
        pattern = re.compile(
            r"model\.layers\.(\d+)\.block_sparse_moe\.experts\.(\d+)\.(w1|w2|w3)\.weight"
        )
    else:
        pattern = re.compile(
            r"model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight"
        )
    found = {match.groups() for name in names if (match := pattern.fullmatch(name))}
    moe_layers = {layer for layer, _, _ in found}
    assert len(found) == len(moe_layers) * EXPERTS * 3
    assert not any("gate_up_proj" in name for name in names)


@pytest.mark.parametrize("family", FAMILIES)
def test_reload_reproduces_logits(checkpoints: dict[str, Path], family: str) -> None:
    in_memory, _ = build_tiny_model(family)
    loaded = _load(checkpoints[family])
    ids = _random_ids(3, 17)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, in_memory(ids).logits, rtol=0, atol=0)


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_decoding_has_clear_winners(checkpoints: dict[str, Path], family: str) -> None:
    model = _load(checkpoints[family])
    prompts = _random_ids(6, 8, seed=1)
    ids = prompts
    gaps, top_probs = [], []
    with torch.no_grad():
        for _ in range(24):
            logits = model(ids).logits[:, -1]  # [prompts, vocab]
            top2 = logits.topk(2, dim=-1).values
            gaps.append(top2[:, 0] - top2[:, 1])
            top_probs.append(logits.softmax(-1).max(-1).values)
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], dim=1)
        # generation_config makes HF generate greedy (its KV-cache path, unlike the loop above).
        mask = torch.ones_like(prompts)
        generated = model.generate(prompts, max_new_tokens=12, attention_mask=mask)[:, 8:]
    gap, top_prob = torch.cat(gaps), torch.cat(top_probs)
    assert gap.min() > 1e-4
    assert gap.median() > 1e-2
    assert top_prob.median() < 0.9  # not saturated: the runner-up tokens still matter
    for row, expected in zip(generated, ids[:, 8:20], strict=True):  # eos stops a row, pads follow
        stop = (expected == EOS_ID).nonzero()
        end = int(stop[0]) + 1 if len(stop) else len(expected)
        assert row[:end].tolist() == expected[:end].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_routers_spread_tokens(family: str) -> None:
    model, _ = build_tiny_model(family)
    chosen: dict[str, torch.Tensor] = {}

    def record(name: str):
        def hook(_module: torch.nn.Module, _args: object, output: tuple[torch.Tensor, ...]) -> None:
            chosen[name] = output[2]  # [tokens, top_k] expert ids

        return hook

    for name, module in model.named_modules():
        if name.endswith("mlp.gate") and hasattr(module, "top_k"):
            module.register_forward_hook(record(name))
    with torch.no_grad():
        model(_random_ids(4, 16, seed=2))
    assert len(chosen) >= 3
    for name, experts in chosen.items():
        assert experts.unique().numel() >= EXPERTS - 1, name
        pairs = {tuple(sorted(row)) for row in experts.tolist()}
        assert len(pairs) >= 8, (name, pairs)
    if family == "deepseek_v3":
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                assert (buffer != 0).all() and buffer.abs().max() < 0.5


def test_byte_tokenizer_round_trips(checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["mixtral"])
    assert len(tokenizer) == VOCAB_SIZE
    assert (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id) == (
        BOS_ID,
        EOS_ID,
        PAD_ID,
    )
    ids = tokenizer(TEXT)["input_ids"]
    assert ids == list(TEXT.encode("utf-8"))
    assert tokenizer.decode(ids) == TEXT
    assert tokenizer.decode([BOS_ID, *ids, EOS_ID], skip_special_tokens=True) == TEXT


def test_chat_template(checkpoints: dict[str, Path]) -> None:
    tokenizer = AutoTokenizer.from_pretrained(checkpoints["qwen3_moe"])
    messages = [{"role": "system", "content": "sé brief"}, {"role": "user", "content": "hi ✓"}]
    prompt = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert prompt == (
        "<|bos|><|im_start|>system\nsé brief<|eos|>\n"
        "<|im_start|>user\nhi ✓<|eos|>\n<|im_start|>assistant\n"
    )
    closed = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert prompt.startswith(closed) and not closed.endswith("assistant\n")
    ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    assert ids[0] == BOS_ID and ids.count(EOS_ID) == 2
    assert tokenizer.decode(ids) == prompt


@pytest.mark.parametrize("family", ["deepseek_v3", "mixtral"])
def test_hash_layers(tmp_path: Path, family: str) -> None:
    path = make_tiny_model(tmp_path / "hash", family, hash_layers=1, seed=3)
    config = AutoConfig.from_pretrained(path)
    first_moe = 1 if family == "deepseek_v3" else 0
    assert config.num_hash_layers == 1
    assert config.mlp_layer_types[first_moe] == "hash_moe"
    assert config.mlp_layer_types.count("hash_moe") == 1
    name = f"{gate_prefix(family, first_moe)}.tid2eid"
    assert sum(n.endswith("tid2eid") for n in _weight_names(path)) == 1
    with safe_open(path / "model.safetensors", "pt") as f:
        table = f.get_tensor(name)
        assert f.get_tensor(f"{gate_prefix(family, first_moe)}.weight").shape == (EXPERTS, 64)
    assert table.dtype == torch.int64 and table.shape == (VOCAB_SIZE, 2)
    assert table.min() >= 0 and table.max() < EXPERTS
    assert (table[:, 0] != table[:, 1]).all()
    assert table.unique().numel() == EXPERTS
    _, tables = build_tiny_model(family, hash_layers=1, seed=3)
    assert torch.equal(tables[name], table)
    _, other_seed = build_tiny_model(family, hash_layers=1, seed=4)
    assert not torch.equal(other_seed[name], table)
    _load(path, hash_tables=1)


@pytest.mark.parametrize("family", FAMILIES)
def test_sharded_copy_loads(checkpoints: dict[str, Path], tmp_path: Path, family: str) -> None:
    source = checkpoints[family]
    sharded = shard_checkpoint(source, tmp_path / "sharded", max_shard_bytes=300_000)
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    shards = sorted(sharded.glob("model-*-of-*.safetensors"))
    assert len(shards) >= 3 and set(index["weight_map"].values()) == {p.name for p in shards}
    assert set(index["weight_map"]) == _weight_names(source)
    assert not (sharded / "model.safetensors").exists()
    for name in (
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ):
        assert (sharded / name).read_bytes() == (source / name).read_bytes()
    ids = _random_ids(2, 9, seed=4)
    with torch.no_grad():
        expected = _load(source)(ids).logits
        torch.testing.assert_close(_load(sharded)(ids).logits, expected, rtol=0, atol=0)


def test_half_precision_checkpoint(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "bf16", "deepseek_v3", hash_layers=2, dtype="bfloat16")
    with safe_open(path / "model.safetensors", "pt") as f:
        dtypes = {name: f.get_tensor(name).dtype for name in f.keys()}
    assert {d for n, d in dtypes.items() if n.endswith("tid2eid")} == {torch.int64}
    assert {d for n, d in dtypes.items() if not n.endswith("tid2eid")} == {torch.bfloat16}
    assert json.loads((path / "config.json").read_text())["dtype"] == "bfloat16"
    assert AutoConfig.from_pretrained(path).mlp_layer_types == [
        "dense",
        "hash_moe",
        "hash_moe",
        "moe",
    ]


def test_rejects_bad_arguments(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="family='llama'"):
        make_tiny_model(tmp_path / "a", "llama")
    with pytest.raises(ValueError, match="dtype='int8'"):
        make_tiny_model(tmp_path / "b", "mixtral", dtype="int8")
    with pytest.raises(ValueError, match="hash_layers=4 exceeds the 3 MoE layers"):
        make_tiny_model(tmp_path / "c", "qwen3_moe", hash_layers=4)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "stale.safetensors").write_bytes(b"")
    with pytest.raises(FileExistsError, match="not empty"):
        make_tiny_model(tmp_path / "d", "mixtral")
