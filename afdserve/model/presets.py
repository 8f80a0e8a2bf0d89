"""Published model configs, as Hugging Face config.json dicts, for random-weight benchmarks at real
sizes (`afdserve bench decode --preset NAME --random-weights`). Only fields afdserve or transformers
read are kept; each preset names the config.json it was copied from. `write_preset_config` (the
`afdserve make-config` command) writes one as a model directory for `load_format="dummy"`.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from afdserve.model.config import ModelConfig, parse_model_config

# https://huggingface.co/Qwen/Qwen3-30B-A3B/blob/main/config.json (numbers cross-checked against the
# Megatron launch script scripts/models/qwen3-30B-A3B.sh in slime, github.com/zyzshishui/slime).
QWEN3_30B_A3B: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "attention_bias": False,
    "bos_token_id": 151643,
    "decoder_sparse_step": 1,
    "eos_token_id": 151645,
    "head_dim": 128,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "rms_norm_eps": 1e-6,
    "rope_theta": 1000000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 151936,
}

# https://huggingface.co/deepseek-ai/DeepSeek-V2-Lite/blob/main/config.json (layer and MoE sizes
# cross-checked against Megatron's DeepSeek-V2-Lite model config: 27 layers, 64 experts, 1408).
DEEPSEEK_V2_LITE: dict[str, Any] = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "attention_bias": False,
    "bos_token_id": 100000,
    "eos_token_id": 100001,
    "first_k_dense_replace": 1,
    "hidden_act": "silu",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "kv_lora_rank": 512,
    "max_position_embeddings": 163840,
    "moe_intermediate_size": 1408,
    "moe_layer_freq": 1,
    "n_group": 1,
    "n_routed_experts": 64,
    "n_shared_experts": 2,
    "norm_topk_prob": False,
    "num_attention_heads": 16,
    "num_experts_per_tok": 6,
    "num_hidden_layers": 27,
    "num_key_value_heads": 16,
    "q_lora_rank": None,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-6,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 40,
        "mscale": 0.707,
        "mscale_all_dim": 0.707,
        "original_max_position_embeddings": 4096,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.0,
    "scoring_func": "softmax",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "greedy",
    "torch_dtype": "bfloat16",
    "v_head_dim": 128,
    "vocab_size": 102400,
}

# https://huggingface.co/mistralai/Mixtral-8x7B-v0.1/blob/main/config.json
MIXTRAL_8X7B: dict[str, Any] = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "attention_dropout": 0.0,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "rms_norm_eps": 1e-5,
    "rope_theta": 1000000.0,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 32000,
}

# A Qwen3-MoE shaped toy for CPU smoke runs of the benchmark itself: not a published model.
TINY: dict[str, Any] = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "bos_token_id": 1,
    "eos_token_id": 2,
    "head_dim": 16,
    "hidden_act": "silu",
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 4096,
    "moe_intermediate_size": 32,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "rms_norm_eps": 1e-6,
    "rope_theta": 10000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "float32",
    "vocab_size": 512,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "tiny": TINY,
}


def preset_hf_config(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's config.json dict (callers may edit it)."""
    if name not in PRESETS:
        raise ValueError(f"preset={name!r} is not known: one of {sorted(PRESETS)}")
    return copy.deepcopy(PRESETS[name])


def preset_config(name: str) -> ModelConfig:
    return parse_model_config(preset_hf_config(name))


def write_preset_config(name: str, out_dir: str | Path) -> Path:
    """Write the preset's config.json into `out_dir` (created if needed): a model directory with
    no weights and no tokenizer, for `load_format="dummy"`. An equal config.json already there is
    kept; any other file there is refused."""
    config = preset_hf_config(name)
    out_dir = Path(out_dir)
    path = out_dir / "config.json"
    existing = sorted(p.name for p in out_dir.iterdir()) if out_dir.is_dir() else []
    if existing:
        if existing != ["config.json"] or json.loads(path.read_text()) != config:
            raise FileExistsError(f"out_dir={str(out_dir)!r} holds {existing}, not this preset's "
                                  f"config.json alone; give a new or empty folder")
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
