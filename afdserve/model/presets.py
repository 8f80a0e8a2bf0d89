"""Published model configs, as Hugging Face config.json dicts, for random-weight benchmarks at real
sizes (`afdserve bench decode --preset NAME --random-weights`). Only fields afdserve or transformers
read are kept; each preset names the config.json it was copied from. `write_preset_config` (the
`afdserve make-config` command) writes one as a model directory for `load_format="dummy"`.

A preset name may end in `:LAYERS` (`deepseek-v4-flash:4`): the same config with only its first
LAYERS layers, so that a model too large for one GPU (DeepSeek-V4-Flash: 43 layers of 256
experts, about 160 GB in its FP8/FP4 precision) still runs its real layer shapes on one. Every
place a preset is named reads it through `preset_hf_config`, so the suffix works everywhere.
"""

from __future__ import annotations

import copy
import json
from pathlib import Path
from typing import Any

from afdserve.model.config import ModelConfig, read_hf_config
from afdserve.model.families import REGISTERED, parse_model_config

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

# https://huggingface.co/deepseek-ai/DeepSeek-V4-Flash/blob/main/config.json: 284B parameters, 13B
# active (its model card). Transcribed field by field (the same values are in the V4-Flash test
# fixtures of several public inference engines, e.g. the one in rtp-llm's
# dsv4_checkpoint_inventory_test.py); compress_ratios has 44 entries for 43 layers, the last one
# the MTP layer's, which afdserve does not build. Its weights: FP8 projections with ue8m0 block
# scales, FP4 routed experts (model/families/deepseek_v4/quant.py), so dummy weights take that
# precision.
DEEPSEEK_V4_FLASH: dict[str, Any] = {
    "architectures": ["DeepseekV4ForCausalLM"],
    "model_type": "deepseek_v4",
    "attention_bias": False,
    "bos_token_id": 0,
    "compress_ratios": [0, 0] + [4, 128] * 20 + [4, 0],
    "compress_rope_theta": 160000,
    "eos_token_id": 1,
    "expert_dtype": "fp4",
    "hc_eps": 1e-6,
    "hc_mult": 4,
    "hc_sinkhorn_iters": 20,
    "head_dim": 512,
    "hidden_act": "silu",
    "hidden_size": 4096,
    "index_head_dim": 128,
    "index_n_heads": 64,
    "index_topk": 512,
    "max_position_embeddings": 1048576,
    "moe_intermediate_size": 2048,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 6,
    "num_hash_layers": 3,
    "num_hidden_layers": 43,
    "num_key_value_heads": 1,
    "num_nextn_predict_layers": 1,
    "o_groups": 8,
    "o_lora_rank": 1024,
    "q_lora_rank": 1024,
    "qk_rope_head_dim": 64,
    "quantization_config": {
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
        "quant_method": "fp8",
        "scale_fmt": "ue8m0",
        "weight_block_size": [128, 128],
    },
    "rms_norm_eps": 1e-6,
    "rope_scaling": {
        "beta_fast": 32,
        "beta_slow": 1,
        "factor": 16,
        "original_max_position_embeddings": 65536,
        "type": "yarn",
    },
    "rope_theta": 10000,
    "routed_scaling_factor": 1.5,
    "scoring_func": "sqrtsoftplus",
    "sliding_window": 128,
    "swiglu_limit": 10.0,
    "tie_word_embeddings": False,
    "topk_method": "noaux_tc",
    "torch_dtype": "bfloat16",
    "vocab_size": 129280,
}

PRESETS: dict[str, dict[str, Any]] = {
    "qwen3-30b-a3b": QWEN3_30B_A3B,
    "deepseek-v2-lite": DEEPSEEK_V2_LITE,
    "mixtral-8x7b": MIXTRAL_8X7B,
    "deepseek-v4-flash": DEEPSEEK_V4_FLASH,
    "tiny": TINY,
    # Each family folder may publish its own (model/parts.py's Family.presets).
    **{name: config for family in REGISTERED for name, config in family.presets.items()},
}
LAYERS_SEP = ":"
PRESET_HELP = (
    f"a published config: one of {sorted(PRESETS)}, optionally NAME{LAYERS_SEP}LAYERS "
    "for its first LAYERS layers only"
)


def parse_preset(name: str) -> tuple[str, int | None]:
    """`NAME` or `NAME:LAYERS` -> (the preset, the layers kept; None: all)."""
    base, sep, layers = name.partition(LAYERS_SEP)
    if base not in PRESETS:
        raise ValueError(
            f"preset={name!r} is not known: one of {sorted(PRESETS)}, optionally "
            f"followed by {LAYERS_SEP}LAYERS"
        )
    if not sep:
        return base, None
    total = PRESETS[base]["num_hidden_layers"]
    if not (layers.isdigit() and 1 <= int(layers) <= total):
        raise ValueError(
            f"preset={name!r}: the layers kept after {LAYERS_SEP!r} must be an "
            f"integer in [1, {total}] ({base} has {total})"
        )
    return base, int(layers)


def preset_hf_config(name: str) -> dict[str, Any]:
    """A fresh copy of the preset's config.json dict (callers may edit it); with `:LAYERS`, its
    num_hidden_layers is LAYERS (the per-layer lists stay as published: every family's parser
    reads their first num_hidden_layers entries)."""
    base, layers = parse_preset(name)
    config = copy.deepcopy(PRESETS[base])
    if layers is not None:
        config["num_hidden_layers"] = layers
    return config


def hf_config_of(preset: str | None, model_dir: str | None) -> dict[str, Any]:
    """The config.json dict of a preset, or else of a model directory (what a bench or the
    planner names with --preset NAME or --model DIR)."""
    return preset_hf_config(preset) if preset else read_hf_config(model_dir)


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
            raise FileExistsError(
                f"out_dir={str(out_dir)!r} holds {existing}, not this preset's "
                f"config.json alone; give a new or empty folder"
            )
        return out_dir
    out_dir.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(config, indent=2) + "\n")
    return out_dir
