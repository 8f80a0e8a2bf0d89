"""The published configs of DeepSeek-V3.2 and GLM-5 (`--preset deepseek-v3.2`, `glm-5`), for
make-config and the benches. Field values as the public config.json files give them."""

from __future__ import annotations

from typing import Any

_FP8 = {
    "activation_scheme": "dynamic",
    "fmt": "e4m3",
    "quant_method": "fp8",
    "scale_fmt": "ue8m0",
    "weight_block_size": [128, 128],
}

# https://huggingface.co/deepseek-ai/DeepSeek-V3.2/blob/main/config.json. No verbatim copy of it
# was found to check against (no network to huggingface.co); the fields that set shapes and routing
# agree with every public restatement found: kvcache-ai/kvcache-blog's model table (index_*,
# kv_lora_rank, q/k/v head dims, 61 layers, 128 KV heads, 163840 positions), and DeepSeek-V3.2-Exp
# config transcriptions in other engines' loaders (q_lora_rank 1536, n_group 8 / topk_group 4,
# first_k_dense_replace 3, routed_scaling_factor 2.5, YaRN factor 40). The metadata fields
# (transformers_version, ...) are left out.
DEEPSEEK_V32: dict[str, Any] = {
    "architectures": ["DeepseekV32ForCausalLM"],
    "model_type": "deepseek_v32",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "bos_token_id": 0,
    "eos_token_id": 1,
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "hidden_act": "silu",
    "hidden_size": 7168,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 2048,
    "initializer_range": 0.02,
    "intermediate_size": 18432,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 8,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 61,
    "num_key_value_heads": 128,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 1536,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "quantization_config": _FP8,
    "rms_norm_eps": 1e-6,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 4,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "use_cache": True,
    "v_head_dim": 128,
    "vocab_size": 129280,
}

# https://huggingface.co/zai-org/GLM-5/blob/main/config.json (bf16; GLM-5-FP8 adds the FP8
# quantization_config). Every layer runs its own indexer (no indexer_types / index_topk_freq).
# Checked field by field against two public transcriptions of it: an Ascend (omni-infer) GLM-5
# deployment guide that reprints it with only model_type/architectures/quantization_config
# changed, and prime-rl's GLM-5 weight-transfer test script ("exact GLM-5 dimensions", fewer
# layers and experts); the defaults of jd-opensource/xllm's xllm/models/llm/glm5.h, which names
# this file, agree. head_dim (64) is the rope slice, which transformers derives anyway.
GLM_5: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "model_type": "glm_moe_dsa",
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "bfloat16",
    "eos_token_id": [154820, 154827, 154829],
    "ep_size": 1,
    "first_k_dense_replace": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_topk": 2048,
    "indexer_rope_interleave": True,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "kv_lora_rank": 512,
    "max_position_embeddings": 202752,
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 78,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1,
    "pad_token_id": 154820,
    "pretraining_tp": 1,
    "q_lora_rank": 2048,
    "qk_head_dim": 256,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_interleave": True,
    "rope_parameters": {"rope_theta": 1000000, "rope_type": "default"},
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "transformers_version": "5.0.2.dev0",
    "use_cache": True,
    "v_head_dim": 256,
    "vocab_size": 154880,
}

PRESETS = {"deepseek-v3.2": DEEPSEEK_V32, "glm-5": GLM_5}
