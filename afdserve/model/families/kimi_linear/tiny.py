"""A tiny Kimi-Linear checkpoint, written by transformers' own `KimiLinearForCausalLM` (its
forward is the oracle), for CPU tests and `afdserve make-tiny-model --family kimi_linear`.

Kimi Delta Attention layers before and after an MLA one, a dense first layer, grouped sigmoid
routing with a score bias and a shared expert, per-channel decays slow enough that the state
carries tokens far back. `save_pretrained` writes the public names (`self_attn.f_a_proj`,
`q_conv1d`, `block_sparse_moe.experts.E.w1`), which real checkpoints use. The vocabulary is the
byte tokenizer's, which make_tiny_model writes beside.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import KimiLinearConfig, KimiLinearForCausalLM

from afdserve.model.fixtures.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE
from afdserve.model.fixtures.seeded import save_plain, seeded_model

TINY_KIMI = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 32,
    "intermediate_size": 24,
    "moe_intermediate_size": 16,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "full_attention", "linear_attention", "linear_attention"],
    "mlp_layer_types": ["dense", "sparse", "sparse", "sparse"],
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "q_lora_rank": 16,
    "kv_lora_rank": 16,
    "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8,
    "v_head_dim": 8,
    "linear_num_heads": 2,
    "linear_head_dim": 8,
    "linear_conv_kernel_dim": 4,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "n_group": 2,
    "topk_group": 1,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.0,
    "max_position_embeddings": 512,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
LM_HEAD_GAIN, ROUTER_GAIN, JITTER, SCORE_BIAS_STD = 3.0, 2.0, 0.1, 0.05


def build_tiny_kimi(seed: int = 0, dtype: str = "float32") -> KimiLinearForCausalLM:
    config = KimiLinearConfig(**TINY_KIMI)
    return seeded_model(KimiLinearForCausalLM, config, seed, dtype, _init_weights)


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
        out_dir, model_type, hash_layers, quantization, lambda: build_tiny_kimi(seed, dtype)
    )


@torch.no_grad()
def _init_weights(model: KimiLinearForCausalLM, rng: torch.Generator) -> None:
    """Every parameter from `rng`, in name order: matrices std gain / sqrt(fan_in), norms near
    1, decay rates exp(A_log) of 0.05 to 0.5, the routers' score bias small."""
    for name, param in sorted(model.named_parameters()):
        noise = torch.randn(param.shape, generator=rng)
        if name.endswith("A_log"):
            values = torch.empty(param.shape).uniform_(0.05, 0.5, generator=rng).log()
        elif name.endswith("dt_bias"):
            values = -1.0 + JITTER * noise
        elif param.ndim == 1:
            values = 1.0 + JITTER * noise
        elif name.endswith("embed_tokens.weight"):
            values = noise
        else:
            gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
            gain = ROUTER_GAIN if name.endswith("mlp.gate.weight") else gain
            values = gain / math.sqrt(param.shape[-1]) * noise
        param.copy_(values.to(param.dtype))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(SCORE_BIAS_STD * torch.randn(buffer.shape, generator=rng))
