"""DeepSeek-V4 style hash-routed MoE layers: experts come from a frozen `tid2eid[token_id]` table.

transformers' own classes of the four families ignore that table, so the oracles are (a) the
formula written out here, (b) transformers' `DeepseekV4HashRouter` holding the same weight and
table, and (c) the family's transformers model with its hash layers' gates replaced by that router,
generating greedily against afdserve's engine.
"""

from __future__ import annotations

import json
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from afdserve import LLM, SamplingParams
from afdserve.model.checkpoint.loader import CheckpointError, load_model
from afdserve.model.families.decoder.model import MoECausalLM
from afdserve.model.fixtures.byte_tokenizer import PAD_ID, VOCAB_SIZE
from afdserve.model.fixtures.tiny import FAMILIES, gate_prefix, make_tiny_model
from afdserve.model.layers.moe import Router, TokenIdError
from afdserve.model.parts import ModelParts

NEW_TOKENS = 24
PROMPTS = [
    [9],
    [104, 97, 115, 104],
    list(range(60, 90)),
    [256, 1, 2, 3, 250, 251, 252],
    [(29 * i) % 256 for i in range(40)],
    [33] * 11,
]


def checkpoint(path: Path) -> dict[str, torch.Tensor]:
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def hf_config(path: Path) -> dict:
    return json.loads((path / "config.json").read_text())


def hash_layers(path: Path) -> list[int]:
    return [i for i, kind in enumerate(hf_config(path)["mlp_layer_types"]) if kind == "hash_moe"]


def score_fn(family: str):
    return torch.sigmoid if family == "deepseek_v3" else partial(torch.softmax, dim=-1)


def scaling(path: Path) -> float:
    return float(hf_config(path).get("routed_scaling_factor", 1.0))


def router(model: MoECausalLM, layer: int) -> Router:
    return model.model.layers[layer].mlp.gate


@pytest.fixture(scope="module")
def ours(hash_models: dict[str, Path]) -> dict[str, MoECausalLM]:
    return {
        family: load_model(path, ModelParts.colocated(), "float32")[0]
        for family, path in hash_models.items()
    }


def random_rows(rows: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, 64, generator=gen)
    token_ids = torch.randint(0, VOCAB_SIZE, (rows,), generator=gen)
    token_ids[::7] = -1  # pad rows
    return x, token_ids


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_router_follows_the_hash_formula(
    family: str, hash_models: dict[str, Path], ours: dict
) -> None:
    path = hash_models[family]
    weights_on_disk = checkpoint(path)
    layers = hash_layers(path)
    assert layers and tuple(layers) == ours[family].config.hash_layers
    for layer in layers:
        table = weights_on_disk[f"{gate_prefix(family, layer)}.tid2eid"]
        gate = weights_on_disk[f"{gate_prefix(family, layer)}.weight"]
        x, token_ids = random_rows(64, seed=layer)
        ids, weights = router(ours[family], layer)(x, token_ids)
        # Pad id -1 looks up row 0; its output is dropped by the caller.
        want_ids = table[token_ids.clamp(min=0)]
        picked = score_fn(family)(x @ gate.T).gather(1, want_ids)
        want = picked / (picked.sum(-1, keepdim=True) + 1e-20) * scaling(path)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want, atol=1e-6, rtol=1e-5)
        # The table, not the gate, picks: top-k of the scores would often choose otherwise.
        top = score_fn(family)(x @ gate.T).topk(ids.shape[1]).indices.sort(-1).values
        assert (top != ids.sort(-1).values).any(-1).float().mean() > 0.3


def v4_router(family: str, path: Path, layer: int) -> nn.Module:
    """transformers' DeepseekV4HashRouter with the checkpoint's gate weight and table."""
    from transformers.models.deepseek_v4.configuration_deepseek_v4 import DeepseekV4Config
    from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4HashRouter

    raw = hf_config(path)
    config = DeepseekV4Config(
        vocab_size=raw["vocab_size"],
        hidden_size=raw["hidden_size"],
        n_routed_experts=8,
        num_experts_per_tok=raw["num_experts_per_tok"],
        num_hidden_layers=2,
        scoring_func="sigmoid",
        routed_scaling_factor=scaling(path),
    )
    hf_router = DeepseekV4HashRouter(config).eval()
    if family != "deepseek_v3":
        # V4's activation table has no softmax; the score function is the family's own.
        hf_router.score_fn = nn.Softmax(dim=-1)
    weights = checkpoint(path)
    with torch.no_grad():
        hf_router.weight.copy_(weights[f"{gate_prefix(family, layer)}.weight"])
        hf_router.tid2eid.copy_(weights[f"{gate_prefix(family, layer)}.tid2eid"])
    return hf_router


@pytest.mark.parametrize("family", FAMILIES)
@torch.inference_mode()
def test_router_matches_transformers_v4_hash_router(
    family: str, hash_models: dict[str, Path], ours: dict
) -> None:
    path = hash_models[family]
    for layer in hash_layers(path):
        x, token_ids = random_rows(50, seed=100 + layer)
        token_ids = token_ids.clamp(min=0)  # V4 has no pad rows
        _, want_weights, want_ids = v4_router(family, path, layer)(x, token_ids)
        ids, weights = router(ours[family], layer)(x, token_ids)
        assert torch.equal(ids, want_ids)
        torch.testing.assert_close(weights, want_weights, atol=1e-6, rtol=1e-5)


class HashGate(nn.Module):
    """A hash layer's gate inside the family's transformers model: the family's own call and
    return `(logits, weights, ids)`, the experts from V4's hash router fed the current token ids."""

    def __init__(self, hf_router: nn.Module, current_ids: dict[str, torch.Tensor]) -> None:
        super().__init__()
        self.hf_router = hf_router
        self.current_ids = current_ids

    def forward(self, hidden_states: torch.Tensor):
        return self.hf_router(hidden_states, self.current_ids["input_ids"])


def hf_hash_model(family: str, path: Path) -> nn.Module:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    current: dict[str, torch.Tensor] = {}

    def remember_ids(_module: nn.Module, args: tuple, kwargs: dict) -> None:
        current["input_ids"] = kwargs["input_ids"] if "input_ids" in kwargs else args[0]

    model.model.register_forward_pre_hook(remember_ids, with_kwargs=True)
    for layer in hash_layers(path):
        block = model.model.layers[layer]
        moe = block.block_sparse_moe if hasattr(block, "block_sparse_moe") else block.mlp
        moe.gate = HashGate(v4_router(family, path, layer), current)
    return model


@torch.inference_mode()
def hf_greedy(model: nn.Module, prompt: list[int]) -> list[int]:
    ids = torch.tensor([prompt])
    out = model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=NEW_TOKENS,
        do_sample=False,
        eos_token_id=None,
        pad_token_id=PAD_ID,
    )
    return out[0, len(prompt) :].tolist()


@pytest.mark.parametrize("family", FAMILIES)
def test_hash_model_generation_matches_transformers_with_hash_gates(
    family: str, hash_models: dict[str, Path]
) -> None:
    from transformers import AutoModelForCausalLM

    path = hash_models[family]
    llm = LLM(str(path), dtype="float32", block_size=4)
    outs = llm.generate(
        PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
    )
    oracle = hf_hash_model(family, path)
    for prompt, out in zip(PROMPTS, outs, strict=True):
        assert out.token_ids == hf_greedy(oracle, prompt), prompt
    # Without the swap transformers routes the hash layers by the gate: the table must matter.
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    assert any(hf_greedy(plain, p) != out.token_ids for p, out in zip(PROMPTS, outs))


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_token_id_outside_table_names_layer_and_row(
    family: str, hash_models: dict[str, Path], ours: dict
) -> None:
    layer = hash_layers(hash_models[family])[-1]
    gate = router(ours[family], layer)
    x = torch.randn(5, 64)
    for bad in (VOCAB_SIZE, VOCAB_SIZE + 1000, -2):
        token_ids = torch.tensor([3, 5, 7, bad, 11])
        with pytest.raises(TokenIdError, match=rf"layer {layer}\b.*{bad}.*row 3\b"):
            gate(x, token_ids)
        with pytest.raises(TokenIdError, match=rf"layer {layer}\b"):
            ours[family].ffn_half(layer, x, token_ids)
    # The pad id -1 is accepted and routes like id 0.
    ids, weights = gate(x, torch.tensor([-1, 0, 1, 2, 3]))
    assert torch.equal(ids[0], ids[1])


def test_missing_hash_table_is_named(tmp_path: Path) -> None:
    path = make_tiny_model(tmp_path / "model", "deepseek_v3", hash_layers=1, seed=2)
    name = f"{gate_prefix('deepseek_v3', 1)}.tid2eid"
    weights = load_file(path / "model.safetensors")
    del weights[name]
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=name.replace(".", r"\.")):
        load_model(path, ModelParts.colocated(), "float32")
