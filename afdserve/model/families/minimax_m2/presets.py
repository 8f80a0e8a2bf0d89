"""MiniMax-M2's published configs for the benches (`--preset minimax-m2`, model/presets.py):
230B parameters, 10B active; 62 layers of GQA (48 query, 8 KV heads of 128, rotary on 64 of
them) and 256 routed experts of width 1536, top-8; block-scaled FP8 weights, so dummy weights
take that precision. Only the fields afdserve or transformers read, plus those its parser checks
(model/families/minimax_m2/config.py)."""

from __future__ import annotations

from typing import Any

# https://huggingface.co/MiniMaxAI/MiniMax-M2/blob/main/config.json, checked against public
# reprints of it: an Ascend quantisation guide's copy with only quantization_config removed, and
# the same quantization_config in two inference engines' "official config" test fixtures. The
# file names no eos_token_id (MiniMax's end token, 200020, is in generation_config.json only), so
# neither does the preset. Left out as metadata: auto_map, transformers_version, use_cache.
MINIMAX_M2: dict[str, Any] = {
    "architectures": ["MiniMaxM2ForCausalLM"],
    "model_type": "minimax_m2",
    "attn_type_list": [1] * 62,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 3072,
    "intermediate_size": 1536,
    "max_position_embeddings": 196608,
    "mtp_transformer_layers": 1,
    "num_attention_heads": 48,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
    "num_local_experts": 256,
    "num_mtp_modules": 3,
    "qk_norm_type": "per_layer",
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "float8_e4m3fn",
        "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"],
        "quant_method": "fp8",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-6,
    "rope_theta": 5000000,
    "rotary_dim": 64,
    "scoring_func": "sigmoid",
    "shared_intermediate_size": 0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "use_mtp": True,
    "use_qk_norm": True,
    "use_routing_bias": True,
    "vocab_size": 200064,
}

# https://huggingface.co/MiniMaxAI/MiniMax-M2.5/blob/main/config.json: the same architecture and
# the same fields; M2.5 differs from M2 in its weights. No verbatim copy was found; public tables
# of it (kvcache-ai/kvcache-blog: 62 layers, 48/8 heads of 128, rotary_dim 64, 3 MTP modules,
# 196608 positions) agree. (M2.7's differs: max_position_embeddings 204800.)
MINIMAX_M2_5: dict[str, Any] = dict(MINIMAX_M2)

PRESETS = {"minimax-m2": MINIMAX_M2, "minimax-m2.5": MINIMAX_M2_5}
