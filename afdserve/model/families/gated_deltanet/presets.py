"""Published configs of the Gated DeltaNet hybrids, for the benches (model/presets.py)."""

from __future__ import annotations

from typing import Any

# https://huggingface.co/Qwen/Qwen3-Next-80B-A3B-Instruct/blob/main/config.json. No verbatim copy of
# this checkpoint's file was found (no network to huggingface.co); every value below agrees with a
# public transcription of Qwen3-Coder-Next's config.json (the same architecture and sizes; its
# rope_theta, 5e6, is stated there to be half the 80B's) and with transformers' Qwen3NextConfig
# defaults (which name this checkpoint) where they are set. Training-only fields are left out.
QWEN3_NEXT_80B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3NextForCausalLM"],
    "model_type": "qwen3_next",
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 5120,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "max_position_embeddings": 262144,
    "mlp_only_layers": [],
    "moe_intermediate_size": 512,
    "norm_topk_prob": True,
    "num_attention_heads": 16,
    "num_experts": 512,
    "num_experts_per_tok": 10,
    "num_hidden_layers": 48,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_scaling": None,
    "rope_theta": 10000000,
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_sliding_window": False,
    "vocab_size": 151936,
}

# The text_config of https://huggingface.co/Qwen/Qwen3.5-35B-A3B/blob/main/config.json (the
# image-text checkpoint; its sizes are also transformers' Qwen3_5MoeTextConfig defaults, which
# name that checkpoint), as the text-only model_type so that `NAME:LAYERS` can cut it. No verbatim
# copy of this checkpoint's file was found; the values agree with kvcache-ai/kvcache-blog's table
# of it (40 layers, 30 linear + 10 full, 16/2 heads of 256, linear heads 16/32 of 128,
# mtp_num_hidden_layers 1, 262144 positions) and with a public transcription of the text_config
# of Qwen3.6-35B-A3B, its successor on the same architecture. mamba_ssm_dtype is read by nobody:
# the recurrent state is float32 here regardless (gated_deltanet/cache.py).
QWEN3_5_35B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3_5MoeForCausalLM"],
    "model_type": "qwen3_5_moe_text",
    "attention_bias": False,
    "attn_output_gate": True,
    "eos_token_id": 248044,
    "full_attention_interval": 4,
    "head_dim": 256,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "layer_types": (["linear_attention"] * 3 + ["full_attention"]) * 10,
    "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 128,
    "linear_num_key_heads": 16,
    "linear_num_value_heads": 32,
    "linear_value_head_dim": 128,
    "mamba_ssm_dtype": "float32",
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 512,
    "mtp_num_hidden_layers": 1,
    "mtp_use_dedicated_embeddings": False,
    "num_attention_heads": 16,
    "num_experts": 256,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 40,
    "num_key_value_heads": 2,
    "partial_rotary_factor": 0.25,
    "rms_norm_eps": 1e-6,
    "rope_parameters": {
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
    },
    "shared_expert_intermediate_size": 512,
    "tie_word_embeddings": False,
    "dtype": "bfloat16",
    "vocab_size": 248320,
}

PRESETS = {"qwen3-next-80b-a3b": QWEN3_NEXT_80B_A3B, "qwen3.5-35b-a3b": QWEN3_5_35B_A3B}
