"""The published gpt-oss configs, for `make-config` and the benches (`--preset gpt-oss-120b`,
`gpt-oss-20b`, or their first layers, `NAME:LAYERS`)."""

from __future__ import annotations

from typing import Any

# https://huggingface.co/openai/gpt-oss-120b/blob/main/config.json, checked field by field against
# public verbatim transcriptions (one read from huggingface.co's raw file, as another project's
# test fixture) and against transformers' GptOssConfig, whose defaults are this checkpoint's.
GPT_OSS_120B: dict[str, Any] = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "eos_token_id": 200002,
    "experts_per_token": 4,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 2880,
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "intermediate_size": 2880,
    "layer_types": ["sliding_attention", "full_attention"] * 18,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_attention_heads": 64,
    "num_experts_per_tok": 4,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "num_local_experts": 128,
    "output_router_logits": False,
    "pad_token_id": 199999,
    "quantization_config": {
        "modules_to_not_convert": [
            "model.layers.*.self_attn",
            "model.layers.*.mlp.router",
            "model.embed_tokens",
            "lm_head",
        ],
        "quant_method": "mxfp4",
    },
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "transformers_version": "4.55.0.dev0",
    "use_cache": True,
    "vocab_size": 201088,
}

# https://huggingface.co/openai/gpt-oss-20b/blob/main/config.json: 120b's but for the depth
# and the number of experts (checked against a verbatim copy in circuit-tracer's gpt-oss test).
GPT_OSS_20B: dict[str, Any] = {
    **GPT_OSS_120B,
    "layer_types": ["sliding_attention", "full_attention"] * 12,
    "num_hidden_layers": 24,
    "num_local_experts": 32,
}

PRESETS = {"gpt-oss-120b": GPT_OSS_120B, "gpt-oss-20b": GPT_OSS_20B}
