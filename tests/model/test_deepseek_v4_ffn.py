"""DeepSeek-V4's FFN half, loaded from the public tensor names into afdserve's stacked experts,
against transformers' `DeepseekV4SparseMoeBlock` of the same checkpoint: hash and top-k layers,
sqrtsoftplus and sigmoid scores, the SwiGLU clamp, the shared expert. Float32 on random rows
scaled so that the clamp bites."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from transformers import DeepseekV4ForCausalLM

from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.byte_tokenizer import VOCAB_SIZE
from afdserve.model.fixtures.deepseek_v4 import TINY_V4, make_tiny_v4
from afdserve.model.fixtures.tiny import make_tiny_model
from afdserve.model.parts import ModelParts

ROWS = 64
LAYERS = TINY_V4["num_hidden_layers"]


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("v4-ffn")
    return {
        "sqrtsoftplus": make_tiny_model(root / "sqrtsoftplus", "deepseek_v4", hash_layers=1),
        "sigmoid": make_tiny_v4(
            root / "sigmoid",
            seed=3,
            scoring_func="sigmoid",
            mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"],
        ),
    }


def hf_model(path: Path) -> DeepseekV4ForCausalLM:
    return DeepseekV4ForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager"
    ).eval()


def rows(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = 3.0 * torch.randn(ROWS, TINY_V4["hidden_size"], generator=gen)
    return x, torch.randint(0, VOCAB_SIZE, (ROWS,), generator=gen)


@pytest.mark.parametrize("scoring", ["sqrtsoftplus", "sigmoid"])
@torch.inference_mode()
def test_ffn_half_equals_transformers_moe_block(checkpoints: dict[str, Path], scoring: str) -> None:
    path = checkpoints[scoring]
    hf = hf_model(path)
    ffn, report = load_model(path, ModelParts(attention=False, ffn=True), "float32")
    assert report.unexpected == [] and report.skipped_other_half > 0
    limit = TINY_V4["swiglu_limit"]
    for layer in range(LAYERS):
        x, ids = rows(layer)
        block = hf.model.layers[layer].mlp
        assert block.is_hash == (ffn.config.layer_types[layer] == "hash_moe")
        ref = block(x[None], input_ids=ids[None])[0]
        ours = ffn.ffn_half(layer, x, ids)
        # The same operations in the same order (experts in id order, routed then shared); the
        # GEMMs' blocking differs with the batch shape, measured at most 2 ulp (2.4e-7).
        torch.testing.assert_close(ours, ref, atol=1e-6, rtol=1e-6)
        gate = block.shared_experts.gate_proj(x)
        assert bool((gate > limit).any()), "the clamp must bite for the test to mean anything"


@torch.inference_mode()
def test_hash_layers_take_experts_from_the_table(checkpoints: dict[str, Path]) -> None:
    path = checkpoints["sqrtsoftplus"]
    hf = hf_model(path)
    ffn, _ = load_model(path, ModelParts(attention=False, ffn=True), "float32")
    x, ids = rows(7)
    got_ids, weights = ffn.model.layers[0].mlp.gate(x, ids)
    table = hf.model.layers[0].mlp.gate.tid2eid
    assert torch.equal(got_ids, table[ids])
    _, ref_weights, ref_ids = hf.model.layers[0].mlp.gate(x[None], ids[None])
    assert torch.equal(ref_ids, got_ids)
    torch.testing.assert_close(weights, ref_weights, atol=1e-7, rtol=1e-6)


@torch.inference_mode()
def test_softmax_scores_follow_the_formula(checkpoints: dict[str, Path], tmp_path: Path) -> None:
    # transformers' V4 router cannot build `softmax` (no such activation), so the oracle is the
    # formula: softmax over experts, top-k on scores + bias, normalised, times the scale.
    src = checkpoints["sqrtsoftplus"]
    path = tmp_path / "softmax"
    path.mkdir()
    for file in src.iterdir():
        (path / file.name).write_bytes(file.read_bytes())
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "scoring_func": "softmax"}))
    ffn, _ = load_model(path, ModelParts(attention=False, ffn=True), "float32")
    gate = ffn.model.layers[1].mlp.gate
    x, ids = rows(11)
    scores = F.linear(x, gate.weight).softmax(dim=-1)
    want_ids = (scores + gate.e_score_correction_bias).topk(2, dim=-1).indices
    want = scores.gather(1, want_ids)
    want = want / (want.sum(-1, keepdim=True) + 1e-20) * TINY_V4["routed_scaling_factor"]
    got_ids, got = gate(x, ids)
    assert torch.equal(got_ids, want_ids)
    torch.testing.assert_close(got, want, atol=0, rtol=0)


@torch.inference_mode()
def test_gate_on_attention_and_expert_shards_give_the_same_output(
    checkpoints: dict[str, Path],
) -> None:
    path = checkpoints["sqrtsoftplus"]
    full, _ = load_model(path, ModelParts(attention=False, ffn=True), "float32")
    attn, _ = load_model(
        path, ModelParts(attention=True, ffn=False, gate_on_attention=True), "float32"
    )
    routed_ffn, _ = load_model(
        path, ModelParts(attention=False, ffn=True, gate_on_attention=True), "float32"
    )
    shards = [
        load_model(path, ModelParts(attention=False, ffn=True, experts=held), "float32")[0]
        for held in ((0, 1), (2, 3))
    ]
    for layer in range(LAYERS):
        x, ids = rows(100 + layer)
        want = full.ffn_half(layer, x, ids)
        routing = attn.route_on_attention(layer, x, ids)
        assert torch.equal(routed_ffn.ffn_half(layer, x, ids, routing), want)
        # Each shard adds the shared expert; the group adds it once (docs/design.md): here,
        # routed part of shard 0 + routed part of shard 1 + the shared expert once.
        mlp0, mlp1 = shards[0].model.layers[layer].mlp, shards[1].model.layers[layer].mlp
        route = mlp0.gate(x, ids)
        summed = mlp0.experts(x, route) + mlp1.experts(x, route) + mlp0.shared_experts(x)
        torch.testing.assert_close(summed, want, atol=1e-6, rtol=1e-6)
