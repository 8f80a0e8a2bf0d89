"""DeepSeek-V3.2's and GLM-5's config.json: the published ones parse as transformers reads them,
GLM-5's indexer schedule is derived as transformers derives it, and every field afdserve cannot
honour is refused by name."""

from __future__ import annotations

import re

import pytest
import torch
from transformers import DeepseekV32Config, GlmMoeDsaConfig
from transformers.modeling_rope_utils import yarn_apply_mscale

from afdserve.kernels import ops
from afdserve.model.families import cache_layout, parse_model_config
from afdserve.model.families.dsa.presets import DEEPSEEK_V32, GLM_5
from afdserve.model.presets import preset_config


def test_deepseek_v32_preset_reads_as_transformers_does():
    c = preset_config("deepseek-v3.2")
    hf = DeepseekV32Config(**{k: v for k, v in DEEPSEEK_V32.items() if k != "quantization_config"})
    dsa = c.family_config
    assert (c.family, c.num_layers, c.attention) == ("deepseek_v32", 61, "mla")
    assert c.layer_types == tuple("dense" if t == "dense" else "moe" for t in hf.mlp_layer_types)
    assert (dsa.index_topk, dsa.index_n_heads, dsa.index_head_dim) == (2048, 64, 128)
    assert not dsa.indexer_interleave and set(dsa.indexer_types) == {"full"}
    assert c.softmax_scale == pytest.approx(yarn_apply_mscale(hf.rope_parameters, 192**-0.5))
    assert c.quantization is not None and c.quantization.block == (128, 128)
    assert (c.topk_method, c.scoring, c.n_group, c.topk_group) == ("noaux_tc", "sigmoid", 8, 4)
    # Per block of 64 positions: every layer's latent (512 + 64) and indexer key (128), bf16.
    layout = cache_layout(c)
    assert layout.bytes_per_block(64, torch.bfloat16) == 61 * 64 * (576 + 128) * 2
    # Prefix reuse and the FP8 cache allowed; where the Triton kernels load `auto` captures
    # decode and `full` mixed steps (without them a graph would score every row to
    # max_model_len: `auto` stays eager, `full` is refused).
    assert layout.prefix_reuse_refusal(64) is None and layout.fp8_refusal is None
    assert bool(layout.eager_by_default(163840)) != ops.triton_available()
    assert bool(layout.graph_refusal("full")) != ops.triton_available()
    assert layout.graph_refusal("full_decode_only") is None


def test_glm5_preset_reads_as_transformers_does():
    c = preset_config("glm-5")
    hf = GlmMoeDsaConfig(**GLM_5)
    assert (c.family, c.num_layers, c.num_experts, c.top_k) == ("glm_moe_dsa", 78, 256, 8)
    assert c.family_config.indexer_types == tuple(hf.indexer_types)
    assert c.family_config.indexer_interleave
    assert c.softmax_scale == pytest.approx(hf.qk_head_dim**-0.5)
    assert c.rms_norm_eps == hf.rms_norm_eps and c.eos_token_ids == (154820, 154827, 154829)


@pytest.mark.parametrize(
    "fields",
    [
        {"index_topk_freq": 2, "index_skip_topk_offset": 1},
        {"index_topk_freq": 3},
        {"index_topk_pattern": "FSFSFF"},
        {"indexer_types": ["full", "full", "shared", "shared", "full", "shared"]},
    ],
)
def test_glm5_shared_layers_follow_transformers(fields):
    raw = {**GLM_5, "num_hidden_layers": 6, **fields}
    hf = GlmMoeDsaConfig(**raw)
    c = parse_model_config(raw)
    assert c.family_config.indexer_types == tuple(hf.indexer_types)
    specs = cache_layout(c).specs
    shared = [i for i, t in enumerate(hf.indexer_types) if t == "shared"]
    assert [s.layers for s in specs] == [tuple(sorted(set(range(6)) - set(shared))), tuple(shared)]
    assert specs[1].index_dim == 0  # shared layers cache no indexer keys


@pytest.mark.parametrize(
    ("preset", "fields", "message"),
    [
        (DEEPSEEK_V32, {"sliding_window": 4096}, "field 'sliding_window' is not supported"),
        (DEEPSEEK_V32, {"scoring_func": "softmax"}, "scoring_func='softmax'"),
        (DEEPSEEK_V32, {"topk_method": "greedy"}, "topk_method='greedy'"),
        (DEEPSEEK_V32, {"num_key_value_heads": 8}, "num_key_value_heads=8"),
        (DEEPSEEK_V32, {"indexer_rope_interleave": True}, "indexer_rope_interleave=True"),
        (GLM_5, {"indexer_rope_interleave": False}, "indexer_rope_interleave=False"),
        (DEEPSEEK_V32, {"rope_interleave": False}, "rope_interleave=False"),
        (DEEPSEEK_V32, {"moe_layer_freq": 2}, "moe_layer_freq=2"),
        (DEEPSEEK_V32, {"q_lora_rank": None}, "missing required field(s) ['q_lora_rank']"),
        (DEEPSEEK_V32, {"qk_rope_head_dim": 256}, "qk_rope_head_dim=256"),
        (DEEPSEEK_V32, {"layer_types": ["sliding_attention"] * 61}, "layer_types="),
        (DEEPSEEK_V32, {"index_topk_pattern": "F" + "S" * 60}, "shared indexer layers"),
        (GLM_5, {"index_topk_pattern": "S" * 78}, "indexer_types[0] must be 'full'"),
        (GLM_5, {"mlp_layer_types": ["dense", "moe"] * 39}, "mlp_layer_types="),
    ],
)
def test_refused_by_name(preset, fields, message):
    with pytest.raises(ValueError, match=re.escape(message)):
        parse_model_config({**preset, **fields})


def test_a_preset_cut_to_its_first_layers_keeps_their_schedules():
    """NAME:LAYERS keeps the published per-layer lists; the parser reads their first entries."""
    pattern = "FSS" * 26
    raw = {**GLM_5, "index_topk_pattern": pattern, "num_hidden_layers": 4}
    raw["mlp_layer_types"] = ["dense"] * 3 + ["sparse"] * 75
    c = parse_model_config(raw)
    assert c.family_config.indexer_types == ("full", "shared", "shared", "full")
    assert c.layer_types == ("dense", "dense", "dense", "moe")


def test_training_only_fields_are_ignored():
    raw = {**DEEPSEEK_V32, "aux_loss_alpha": 0.001, "seq_aux": True, "router_aux_loss_coef": 0.1}
    assert parse_model_config(raw) == parse_model_config(DEEPSEEK_V32)


@pytest.mark.parametrize("kind", ["indexed_attention", "deepseek_sparse_attention"])
def test_both_transformers_spellings_of_an_indexed_layer_parse_alike(kind):
    """transformers 5.25 writes "indexed_attention", 5.17 "deepseek_sparse_attention": the same
    layer (every layer carries the indexer)."""
    raw = {**DEEPSEEK_V32, "layer_types": [kind] * 61}
    assert parse_model_config(raw) == parse_model_config(DEEPSEEK_V32)
