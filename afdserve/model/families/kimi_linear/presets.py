"""Kimi-Linear's published config, for the benches (model/presets.py)."""

from __future__ import annotations

from typing import Any

# https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct/blob/main/config.json, in the
# field names of transformers' KimiLinearConfig (whose defaults name that checkpoint); an MLA
# layer every fourth, the first layer dense.
KIMI_LINEAR_48B_A3B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "model_type": "kimi_linear",
    "vocab_size": 163840,
    "hidden_size": 2304,
    "intermediate_size": 9216,
    "moe_intermediate_size": 1024,
    "num_hidden_layers": 27,
    "num_attention_heads": 32,
    "num_key_value_heads": 32,
    "n_shared_experts": 1,
    "routed_scaling_factor": 2.446,
    "kv_lora_rank": 512,
    "q_lora_rank": None,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "qk_nope_head_dim": 128,
    "n_group": 1,
    "topk_group": 1,
    "num_experts_per_tok": 8,
    "num_local_experts": 256,
    "norm_topk_prob": True,
    "hidden_act": "silu",
    "max_position_embeddings": 1048576,
    "rms_norm_eps": 1e-5,
    "bos_token_id": 163584,
    "eos_token_id": 163586,
    "tie_word_embeddings": False,
    "first_k_dense_replace": 1,
    "linear_head_dim": 128,
    "linear_num_heads": 32,
    "linear_conv_kernel_dim": 4,
    "torch_dtype": "bfloat16",
}

PRESETS = {"kimi-linear-48b-a3b": KIMI_LINEAR_48B_A3B}
