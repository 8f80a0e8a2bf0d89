"""Tiny DeepSeek-V3.2 and GLM-5 checkpoints by transformers' own models (`Family.make_tiny`).

Shaped so that DSA matters in short prompts: the indexer keeps 4 earlier tokens (index_topk), so
every prompt past 4 tokens attends to a subset, and it has 16 heads and keys of a zero-mean
LayerNorm bias: where relu zeroes every head, tokens tie at score 0.0, and transformers'
torch.topk then picks by shape. GLM-5's layers 1 and 3 reuse the selections of layers 0 and 2
("shared"). `save_pretrained` writes
the public names (`self_attn.indexer.wq_b`, `...mlp.experts.E.gate_proj`); `quantization="fp8"`
rewrites them in the public block-scaled FP8 layout, the indexer's wq_b and wk included.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import (
    DeepseekV32Config,
    DeepseekV32ForCausalLM,
    GlmMoeDsaConfig,
    GlmMoeDsaForCausalLM,
    PreTrainedModel,
)

from afdserve.model.fixtures.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    build_byte_tokenizer,
)
from afdserve.model.fixtures.fp8_checkpoint import quantize_checkpoint
from afdserve.model.fixtures.seeded import empty_out_dir, seeded_model

TINY = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 512,
    "num_experts_per_tok": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0},
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "routed_scaling_factor": 2.5,
    "index_topk": 4,
    "index_n_heads": 16,
    "index_head_dim": 16,
}
BUILDS = {
    "deepseek_v32": (DeepseekV32Config, DeepseekV32ForCausalLM, {"n_group": 4, "topk_group": 2}),
    "glm_moe_dsa": (
        GlmMoeDsaConfig,
        GlmMoeDsaForCausalLM,
        {"n_group": 1, "topk_group": 1, "indexer_types": ["full", "shared", "full", "shared"]},
    ),
}
# As model/fixtures/tiny.py (whose docstring says why): unit-scale activations, logits spread by
# units, a selection bias that flips some expert choices.
LM_HEAD_GAIN, ROUTER_GAIN, NORM_JITTER, SCORE_BIAS_STD = 3.0, 2.0, 0.1, 0.05


def build_tiny_dsa(
    model_type: str, seed: int = 0, dtype: str = "float32", **overrides: object
) -> PreTrainedModel:
    """The in-memory transformers model (eager attention), deterministic in its arguments."""
    if model_type not in BUILDS:
        raise ValueError(f"model_type={model_type!r}: one of {tuple(BUILDS)}")
    config_class, model_class, own = BUILDS[model_type]
    config = config_class(**{**TINY, **own, **overrides})
    return seeded_model(model_class, config, seed, dtype, _init_weights)


def make_tiny_dsa(
    out_dir: str | Path,
    model_type: str,
    hash_layers: int = 0,
    seed: int = 0,
    dtype: str = "float32",
    quantization: str | None = None,
) -> Path:
    """`Family.make_tiny`: the checkpoint, its byte tokenizer, FP8 when asked."""
    if hash_layers:
        raise ValueError(f"hash_layers={hash_layers}: {model_type} has no hash-routed layers")
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r} is not supported; allowed: None, 'fp8'")
    out_dir = empty_out_dir(out_dir)
    build_tiny_dsa(model_type, seed, dtype).save_pretrained(out_dir, safe_serialization=True)
    if quantization == "fp8":
        quantize_checkpoint(out_dir)
    build_byte_tokenizer(out_dir)
    return out_dir


@torch.no_grad()
def _init_weights(model: PreTrainedModel, rng: torch.Generator) -> None:
    """Every parameter random, in name order: matrices std gain / sqrt(fan_in), vectors (norm
    weights) around 1, the indexer's LayerNorm bias and the selection bias small."""
    for name, param in sorted(model.named_parameters()):
        if name.endswith("k_norm.bias"):  # a common offset would align every key
            values = NORM_JITTER * torch.randn(param.shape, generator=rng)
        elif param.ndim == 1:
            values = 1.0 + NORM_JITTER * torch.randn(param.shape, generator=rng)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(param.shape, generator=rng)
        else:
            gain = 1.0
            if name == "lm_head.weight":
                gain = LM_HEAD_GAIN
            elif name.endswith("gate.weight"):
                gain = ROUTER_GAIN
            values = gain / math.sqrt(param.shape[-1]) * torch.randn(param.shape, generator=rng)
        param.copy_(values.to(param.dtype))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(SCORE_BIAS_STD * torch.randn(buffer.shape, generator=rng))
