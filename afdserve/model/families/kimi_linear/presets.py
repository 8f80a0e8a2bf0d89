"""Kimi-Linear's published config, for the benches (model/presets.py)."""

from __future__ import annotations

from typing import Any

# https://huggingface.co/moonshotai/Kimi-Linear-48B-A3B-Instruct/blob/main/config.json, in its own
# field names (the parser reads them and transformers' alike). Transcribed from a public copy of
# it (an MLX conversion's config.json reprinted in a Swift test, its MLX "quantization" block and
# transformers_version left out; the architecture fields agree with transformers'
# KimiLinearConfig defaults, which name this checkpoint). The MLA layers are the 1-indexed
# full_attn_layers, 0-indexed 3, 7, ..., 23 and 26: not every fourth from layer 4, which is what
# transformers and this parser assume when the config names none. The first layer is dense.
# head_dim (72) is published but read by nobody: MLA's is qk_nope_head_dim + qk_rope_head_dim.
KIMI_LINEAR_48B_A3B: dict[str, Any] = {
    "architectures": ["KimiLinearForCausalLM"],
    "bos_token_id": 163584,
    "dtype": "bfloat16",
    "eos_token_id": 163586,
    "first_k_dense_replace": 1,
    "head_dim": 72,
    "hidden_act": "silu",
    "hidden_size": 2304,
    "initializer_range": 0.02,
    "intermediate_size": 9216,
    "kv_lora_rank": 512,
    "linear_attn_config": {
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    "mla_use_nope": True,
    "model_max_length": 1048576,
    "model_type": "kimi_linear",
    "moe_intermediate_size": 1024,
    "moe_layer_freq": 1,
    "moe_renormalize": True,
    "moe_router_activation_func": "sigmoid",
    "num_attention_heads": 32,
    "num_expert_group": 1,
    "num_experts": 256,
    "num_experts_per_token": 8,
    "num_hidden_layers": 27,
    "num_key_value_heads": 32,
    "num_nextn_predict_layers": 0,
    "num_shared_experts": 1,
    "pad_token_id": 163839,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_scaling": None,
    "rope_theta": 10000.0,
    "routed_scaling_factor": 2.446,
    "tie_word_embeddings": False,
    "topk_group": 1,
    "use_cache": True,
    "use_grouped_topk": True,
    "v_head_dim": 128,
    "vocab_size": 163840,
}

PRESETS = {"kimi-linear-48b-a3b": KIMI_LINEAR_48B_A3B}
