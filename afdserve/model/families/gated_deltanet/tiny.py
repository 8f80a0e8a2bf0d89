"""Tiny Qwen3-Next and Qwen3.5-MoE checkpoints, written by transformers' own classes (their
forward is the oracle), for CPU tests and `afdserve make-tiny-model --family ...`.

Small, yet every mechanism runs on short prompts: linear layers before and after a full one,
two value heads per key head, partial rotary, a dense layer (Qwen3-Next's mlp_only_layers), and
decays slow enough that the state carries tokens far back. `qwen3_5_moe` is the image-text
checkpoint with a one-block vision tower, in its public names (`model.language_model.`,
`model.visual.`). The vocabulary is the byte tokenizer's, which make_tiny_model writes beside.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import (
    PreTrainedModel,
    Qwen3_5MoeConfig,
    Qwen3_5MoeForCausalLM,
    Qwen3_5MoeForConditionalGeneration,
    Qwen3_5MoeTextConfig,
    Qwen3NextConfig,
    Qwen3NextForCausalLM,
)

from afdserve.model.fixtures.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from afdserve.model.fixtures.seeded import save_plain, seeded_model

LINEAR, FULL = "linear_attention", "full_attention"
TEXT = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "num_hidden_layers": 4,
    "layer_types": [LINEAR, FULL, LINEAR, LINEAR],
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "linear_num_key_heads": 2,
    "linear_num_value_heads": 4,
    "linear_key_head_dim": 8,
    "linear_value_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 16,
    "shared_expert_intermediate_size": 16,
    "max_position_embeddings": 512,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000.0,
        "partial_rotary_factor": 0.5,
    },
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
QWEN3_NEXT = {**TEXT, "mlp_only_layers": [3], "intermediate_size": 24, "norm_topk_prob": True}
VISION = {
    "depth": 1,
    "hidden_size": 16,
    "intermediate_size": 32,
    "num_heads": 2,
    "patch_size": 2,
    "temporal_patch_size": 2,
    "spatial_merge_size": 2,
    "out_hidden_size": 32,
    "num_position_embeddings": 16,
}
LM_HEAD_GAIN, ROUTER_GAIN, JITTER = 3.0, 2.0, 0.1


def build_tiny(model_type: str, seed: int = 0, dtype: str = "float32") -> PreTrainedModel:
    """The in-memory transformers model (eager attention), deterministic in its arguments."""
    if model_type == "qwen3_next":
        model_class, config = Qwen3NextForCausalLM, Qwen3NextConfig(**QWEN3_NEXT)
    elif model_type == "qwen3_5_moe_text":
        model_class, config = Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig(**TEXT)
    elif model_type == "qwen3_5_moe":
        text = {k: v for k, v in TEXT.items() if k != "tie_word_embeddings"}
        config = Qwen3_5MoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=False)
        model_class = Qwen3_5MoeForConditionalGeneration
    else:
        raise ValueError(f"model_type={model_type!r}: one of qwen3_next, qwen3_5_moe(_text)")
    return seeded_model(model_class, config, seed, dtype, _init_weights)


def make_tiny(
    out_dir: str | Path,
    model_type: str,
    hash_layers: int = 0,
    seed: int = 0,
    dtype: str = "float32",
    quantization: str | None = None,
) -> Path:
    """Family.make_tiny: config.json, generation_config.json and model.safetensors."""
    return save_plain(
        out_dir, model_type, hash_layers, quantization, lambda: build_tiny(model_type, seed, dtype)
    )


@torch.no_grad()
def _init_weights(model: PreTrainedModel, rng: torch.Generator) -> None:
    """Every parameter from `rng`, in name order: matrices std gain / sqrt(fan_in) (logits spread
    by units), zero-centred norms near 0, gated norms near 1, decays exp(g) of 0.5 to 0.95."""
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=rng)
        if name.endswith("A_log"):
            values = torch.empty(param.shape).uniform_(0.05, 0.5, generator=rng).log()
        elif name.endswith("dt_bias"):
            values = -1.0 + JITTER * noise
        elif param.ndim == 1:
            gated = name.endswith("linear_attn.norm.weight") or ".visual." in name
            values = (1.0 if gated else 0.0) + JITTER * noise
        elif name.endswith("embed_tokens.weight"):
            values = noise
        else:
            gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
            gain = ROUTER_GAIN if name.endswith("mlp.gate.weight") else gain
            values = gain / math.sqrt(param.shape[-1]) * noise
        param.copy_(values.to(param.dtype))
