"""DeepSeek-V4's config.json read into ModelConfig: what transformers' DeepseekV4Config derives
(layer types, legacy spellings, both rope bases incl. YaRN) is what afdserve reads, and a field
afdserve does not honour is refused in one line that names it."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import DeepseekV4Config
from transformers.models.deepseek_v4.modeling_deepseek_v4 import DeepseekV4RotaryEmbedding

from afdserve.model.families import parse_model_config
from afdserve.model.fixtures.deepseek_v4 import TINY_V4


def raw_config(**overrides: object) -> dict:
    """config.json as transformers writes it for the tiny V4 (plus overrides)."""
    return json.loads(DeepseekV4Config(**{**TINY_V4, **overrides}).to_json_string())


def test_tiny_config_is_read_field_by_field() -> None:
    c = parse_model_config(raw_config())
    v4 = c.family_config
    assert c.family == "deepseek_v4" and c.attention == "v4"
    assert v4.attention_types == tuple(TINY_V4["layer_types"])
    assert c.layer_types == tuple(TINY_V4["mlp_layer_types"]) and c.hash_layers == (0,)
    assert (v4.csa_rate, v4.hca_rate, v4.sliding_window, v4.hc_mult) == (2, 4, 4, 2)
    assert (v4.index_n_heads, v4.index_head_dim, v4.index_topk) == (8, 8, 2)
    assert (v4.o_groups, v4.o_lora_rank, c.q_lora_rank) == (2, 8, 16)
    assert (c.head_dim, c.qk_rope_head_dim, c.num_kv_heads) == (16, 8, 1)
    assert (c.scoring, c.swiglu_limit, c.routed_scaling_factor) == ("sqrtsoftplus", 1.5, 1.5)
    assert [v4.compress_rate(i) for i in range(4)] == [0, 2, 4, 2]


@pytest.mark.parametrize(
    "rope",
    [
        None,
        {
            "rope_type": "yarn",
            "factor": 16.0,
            "original_max_position_embeddings": 64,
            "beta_fast": 32,
            "beta_slow": 1,
        },
    ],
)
def test_both_rope_bases_match_transformers(rope: dict | None) -> None:
    overrides = {} if rope is None else {"rope_parameters": rope}
    hf = DeepseekV4Config(**{**TINY_V4, **overrides})
    rotary = DeepseekV4RotaryEmbedding(hf)
    c = parse_model_config(json.loads(hf.to_json_string()))
    for label, ours, scale in (
        ("main", c.rope_inv_freq, c.family_config.main_attention_scaling),
        ("compress", c.family_config.compress_inv_freq, c.family_config.compress_attention_scaling),
    ):
        ref = getattr(rotary, f"{label}_inv_freq")
        assert torch.equal(torch.tensor(ours, dtype=torch.float32), ref), label
        assert scale == getattr(rotary, f"{label}_attention_scaling"), label
    if rope is not None:  # YaRN really changed the compressed layers' frequencies
        assert (
            c.family_config.compress_inv_freq
            != parse_model_config(raw_config()).family_config.compress_inv_freq
        )


def test_legacy_spellings_fold_like_transformers() -> None:
    legacy = {
        k: v
        for k, v in TINY_V4.items()
        if k not in ("layer_types", "mlp_layer_types", "compress_rates", "partial_rotary_factor")
    }
    legacy.update(
        compress_ratios=[0, 4, 128, 4],
        num_hash_layers=2,
        qk_rope_head_dim=8,
        compress_rate_csa=2,
        compress_rate_hca=4,
    )
    hf = DeepseekV4Config(**legacy)
    c = parse_model_config({**legacy, "model_type": "deepseek_v4"})
    assert c.family_config.attention_types == tuple(hf.layer_types)
    assert c.layer_types == tuple(hf.mlp_layer_types) == ("hash_moe",) * 2 + ("moe",) * 2
    assert (c.family_config.csa_rate, c.family_config.hca_rate) == (
        2,
        4,
    ) and c.qk_rope_head_dim == hf.qk_rope_head_dim


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {
                "layer_types": [
                    "sliding_attention",
                    "full_attention",
                    "sliding_attention",
                    "sliding_attention",
                ]
            },
            r"layer_types\[1\]='full_attention'",
        ),
        (
            {
                "compress_rates": {
                    "compressed_sparse_attention": 1,
                    "heavily_compressed_attention": 4,
                }
            },
            r"compress_rates\['compressed_sparse_attention'\]=1: must be an int >= 2",
        ),
        (
            {"compress_rates": {"compressed_sparse_attention": 2, "sparse": 4}},
            r"compress_rates\['sparse'\]",
        ),
        ({"mlp_layer_types": ["moe", "dense", "moe", "moe"]}, r"mlp_layer_types\[1\]='dense'"),
        ({"num_key_value_heads": 2}, "num_key_value_heads=2"),
        ({"n_shared_experts": 2}, "n_shared_experts=2"),
        ({"norm_topk_prob": False}, "norm_topk_prob=False"),
        ({"scoring_func": "relu"}, "scoring_func='relu'"),
        ({"mlp_bias": True}, "mlp_bias=True"),
        ({"o_groups": 3}, "o_groups=3"),
        ({"sliding_window": 0}, "sliding_window=0"),
        (
            {"quantization_config": {"quant_method": "fp8"}},
            r"quantization_config\.weight_block_size",
        ),
        ({"expert_dtype": "fp4"}, "expert_dtype='fp4' without a quantization_config"),
        ({"topk_method": "greedy"}, "topk_method='greedy'"),
    ],
)
def test_bad_config_is_refused_naming_the_field(overrides: dict, message: str) -> None:
    raw = {**raw_config(), **overrides}
    with pytest.raises(ValueError, match=message) as err:
        parse_model_config(raw)
    assert "\n" not in str(err.value)


def test_every_field_transformers_writes_is_known() -> None:
    # The full default config (V4-Flash's shape): nothing in it is refused.
    c = parse_model_config(json.loads(DeepseekV4Config().to_json_string()))
    assert (
        c.num_layers == 43
        and c.family_config.attention_types[:2] == ("heavily_compressed_attention",) * 2
    )
    assert c.layer_types[:4] == ("hash_moe",) * 3 + ("moe",)
