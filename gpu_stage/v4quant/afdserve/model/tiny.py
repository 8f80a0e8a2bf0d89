"""Tiny random Hugging Face checkpoints for tests and demos.

`make_tiny_model` writes a directory that looks like a real checkpoint of one MoE family
(config.json, generation_config.json, model.safetensors with per-expert tensors, a byte-level
tokenizer) but is small enough to run on a CPU in milliseconds. The architecture comes from the
`transformers` classes themselves, so their forward pass is the oracle for afdserve's models.

Weights are not HF's default init (std 0.02): in a model this small that gives logits so close
together that greedy decoding is decided by rounding. Every matrix instead gets std
gain / sqrt(fan_in), which keeps activations near unit scale through the layers, so logits are
spread by a few units and routers send different tokens to different experts.

DeepSeek-V4 style hash layers (`hash_layers=N`) mark the first N MoE layers as `hash_moe` in
config.json and add a frozen int64 table `...gate.tid2eid` of shape [vocab_size, top_k] per
hash layer. The transformers classes ignore that table (they route those layers with the gate),
so they are no oracle for hash layers.
"""

from __future__ import annotations

import json
import math
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import (
    DeepseekV2Config,
    DeepseekV2ForCausalLM,
    DeepseekV3Config,
    DeepseekV3ForCausalLM,
    GenerationConfig,
    MixtralConfig,
    MixtralForCausalLM,
    PretrainedConfig,
    PreTrainedModel,
    Qwen3MoeConfig,
    Qwen3MoeForCausalLM,
)

from afdserve.model.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_byte_tokenizer
from afdserve.model.fp8_checkpoint import quantize_checkpoint

FAMILIES = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral")
# Built by its own module and kept out of FAMILIES, which the four families' shared tests iterate.
V4_FAMILY = "deepseek_v4"
ALL_FAMILIES = (*FAMILIES, V4_FAMILY)
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

WEIGHTS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# Scales of the random init (see the module docstring). Logits end up with std ~ LM_HEAD_GAIN;
# router logits with std ~ ROUTER_GAIN; norm weights 1 +- NORM_JITTER so a loader that skips a
# norm weight shows up in parity tests.
LM_HEAD_GAIN = 3.0
ROUTER_GAIN = 2.0
NORM_JITTER = 0.1
# DeepSeek-V3's selection bias is added to sigmoid scores in (0, 1): 0.05 flips some choices
# without drowning the gate.
SCORE_BIAS_STD = 0.05

_ROPE = {"rope_type": "default", "rope_theta": 10000.0}
_COMMON = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "max_position_embeddings": 512,
    "num_experts_per_tok": 2,
    "rope_parameters": _ROPE,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
_MLA = {
    "num_key_value_heads": 4,
    "intermediate_size": 128,
    "moe_intermediate_size": 32,
    "q_lora_rank": 32,
    "kv_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 16,
    "n_routed_experts": 8,
    "n_shared_experts": 1,
    "first_k_dense_replace": 1,
    "n_group": 4,
    "topk_group": 2,
}


@dataclass(frozen=True)
class TinyModelSpec:
    """What to build: the family, how many hash-routed layers, the seed and the weight dtype."""

    family: str
    hash_layers: int = 0
    seed: int = 0
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if self.family not in FAMILIES:
            raise ValueError(f"family={self.family!r} is not supported; allowed: {FAMILIES}")
        if not isinstance(self.hash_layers, int) or self.hash_layers < 0:
            raise ValueError(f"hash_layers={self.hash_layers!r} must be an int >= 0")
        if not isinstance(self.seed, int) or self.seed < 0:
            raise ValueError(f"seed={self.seed!r} must be an int >= 0")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype={self.dtype!r} is not supported; allowed: {tuple(DTYPES)}")


def tiny_config(family: str) -> PretrainedConfig:
    """The tiny transformers config of `family`, without the hash-layer fields."""
    if family == "qwen3_moe":
        return Qwen3MoeConfig(
            **_COMMON,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=128,
            moe_intermediate_size=32,
            num_experts=8,
            norm_topk_prob=True,
            decoder_sparse_step=1,
            mlp_only_layers=[1],
        )
    if family == "deepseek_v2":
        return DeepseekV2Config(
            **_COMMON,
            **_MLA,
            topk_method="group_limited_greedy",
            routed_scaling_factor=1.5,
            norm_topk_prob=False,
            scoring_func="softmax",
        )
    if family == "deepseek_v3":
        return DeepseekV3Config(
            **_COMMON,
            **_MLA,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
            num_mtp_layers=0,
            # Not read by transformers (V3 hard-codes both) but present in real V3 configs.
            scoring_func="sigmoid",
            topk_method="noaux_tc",
        )
    if family == "mixtral":
        return MixtralConfig(
            **_COMMON,
            num_key_value_heads=2,
            head_dim=16,
            intermediate_size=32,
            num_local_experts=8,
            sliding_window=None,
        )
    raise ValueError(f"family={family!r} is not supported; allowed: {FAMILIES}")


def mlp_layer_types(config: PretrainedConfig, hash_layers: int) -> list[str]:
    """One entry per layer: "dense", "hash_moe" (the first `hash_layers` MoE layers) or "moe"."""
    kinds: list[str] = []
    for layer in range(config.num_hidden_layers):
        if config.model_type == "qwen3_moe":
            sparse = (
                layer not in config.mlp_only_layers
                and (layer + 1) % config.decoder_sparse_step == 0
            )
        elif config.model_type in ("deepseek_v2", "deepseek_v3"):
            sparse = layer >= config.first_k_dense_replace
        else:
            sparse = True
        kinds.append("moe" if sparse else "dense")
    moe_layers = [layer for layer, kind in enumerate(kinds) if kind == "moe"]
    if hash_layers > len(moe_layers):
        raise ValueError(
            f"hash_layers={hash_layers} exceeds the {len(moe_layers)} MoE layers of "
            f"{config.model_type} (layers {moe_layers}); allowed: 0..{len(moe_layers)}"
        )
    for layer in moe_layers[:hash_layers]:
        kinds[layer] = "hash_moe"
    return kinds


def gate_prefix(family: str, layer: int) -> str:
    """The on-disk name of a layer's router module (its `.weight`, `.tid2eid` hang off it)."""
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    return f"model.layers.{layer}.{block}.gate"


def build_tiny_model(
    family: str, hash_layers: int = 0, seed: int = 0, dtype: str = "float32"
) -> tuple[PreTrainedModel, dict[str, torch.Tensor]]:
    """The in-memory model and the extra hash tables (on-disk name -> int64 tensor).

    Deterministic in (family, hash_layers, seed, dtype): `make_tiny_model` saves exactly this.
    """
    spec = TinyModelSpec(family, hash_layers, seed, dtype)
    config = tiny_config(family)
    kinds = mlp_layer_types(config, hash_layers)
    config.num_hash_layers = hash_layers
    config.mlp_layer_types = kinds
    model_class = _MODEL_CLASSES[family]
    torch.manual_seed(spec.seed)
    model = model_class(config).eval()
    _init_weights(model, torch.Generator().manual_seed(2 * spec.seed))
    model.to(DTYPES[spec.dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    tables_rng = torch.Generator().manual_seed(2 * spec.seed + 1)
    experts = _num_experts(config)
    tables = {
        f"{gate_prefix(family, layer)}.tid2eid": _hash_table(
            config.vocab_size, experts, config.num_experts_per_tok, tables_rng
        )
        for layer, kind in enumerate(kinds)
        if kind == "hash_moe"
    }
    return model, tables


def make_tiny_model(
    out_dir: str | Path,
    family: str,
    hash_layers: int = 0,
    seed: int = 0,
    dtype: str = "float32",
    quantization: str | None = None,
    expert_dtype: str | None = None,
) -> Path:
    """Write a tiny random checkpoint of `family` with a byte-level tokenizer into `out_dir`.
    `quantization="fp8"`: its linear weights in the public block-scaled FP8 layout
    (model/fp8_checkpoint.py); every dim of a tiny model is below 128, so each weight is one
    partial block with one scale.
    DeepSeek-V4 has its own builder (model/deepseek_v4/tiny.py); its `hash_layers` counts from
    the first layer (every V4 layer is MoE). Quantized, it takes DeepSeek-V4-Flash's layout and
    spelling (model/deepseek_v4/quant_checkpoint.py), its routed experts in `expert_dtype`
    ("fp8" by default, or "fp4": then moe_intermediate_size is 32, since FP4 keeps one scale per
    32 inputs of down_proj)."""
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r} is not supported; allowed: None, 'fp8'")
    if expert_dtype is not None and (family != V4_FAMILY or quantization is None):
        raise ValueError(f"expert_dtype={expert_dtype!r} is for a quantized deepseek_v4 only "
                         "(with quantization='fp8'); allowed: None")
    if family == V4_FAMILY:
        from afdserve.model.deepseek_v4.quant_checkpoint import quantize_v4_checkpoint
        from afdserve.model.deepseek_v4.tiny import TINY_V4, make_tiny_v4

        layers = TINY_V4["num_hidden_layers"]
        if not 0 <= hash_layers <= layers:
            raise ValueError(f"hash_layers={hash_layers} for deepseek_v4: allowed 0..{layers}")
        kinds = ["hash_moe"] * hash_layers + ["moe"] * (layers - hash_layers)
        overrides: dict[str, object] = {"mlp_layer_types": kinds}
        if expert_dtype == "fp4":
            overrides["moe_intermediate_size"] = 32
        path = make_tiny_v4(out_dir, seed, dtype, **overrides)
        if quantization == "fp8":
            quantize_v4_checkpoint(path, expert_dtype or "fp8")
        return path
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"out_dir={str(out_dir)!r} is not empty; give a new or empty folder")
    model, tables = build_tiny_model(family, hash_layers, seed, dtype)
    model.save_pretrained(out_dir, safe_serialization=True)
    if tables:
        weights = load_file(out_dir / WEIGHTS_FILE)
        weights.update(tables)
        save_file(weights, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    if family == "qwen3_moe":
        # transformers writes the aliased `num_local_experts`; real Qwen3-MoE configs say
        # `num_experts`. Keep both so either spelling finds the value.
        _update_json(out_dir / "config.json", {"num_experts": model.config.num_experts})
    if quantization == "fp8":
        quantize_checkpoint(out_dir)
    build_byte_tokenizer(out_dir)
    return out_dir


def shard_checkpoint(src_dir: str | Path, dst_dir: str | Path, max_shard_bytes: int) -> Path:
    """Rewrite a checkpoint as `model-0000k-of-0000n.safetensors` shards plus the index.

    Tensors are packed in name order; a shard closes before it would exceed `max_shard_bytes`
    (a single larger tensor gets a shard of its own). Every non-weight file is copied as is.
    """
    if max_shard_bytes <= 0:
        raise ValueError(f"max_shard_bytes={max_shard_bytes} must be > 0")
    src_dir, dst_dir = Path(src_dir), Path(dst_dir)
    if dst_dir.exists() and any(dst_dir.iterdir()):
        raise FileExistsError(f"dst_dir={str(dst_dir)!r} is not empty; give a new or empty folder")
    weights = _read_weights(src_dir)
    shards: list[dict[str, torch.Tensor]] = [{}]
    shard_bytes = 0
    for name in sorted(weights):
        tensor = weights[name]
        size = tensor.numel() * tensor.element_size()
        if shards[-1] and shard_bytes + size > max_shard_bytes:
            shards.append({})
            shard_bytes = 0
        shards[-1][name] = tensor
        shard_bytes += size
    dst_dir.mkdir(parents=True, exist_ok=True)
    weight_map: dict[str, str] = {}
    for number, shard in enumerate(shards, start=1):
        file_name = f"model-{number:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, dst_dir / file_name, metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(shard, file_name))
    total = sum(t.numel() * t.element_size() for t in weights.values())
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (dst_dir / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n", encoding="utf-8")
    for path in src_dir.iterdir():
        if path.is_file() and path.suffix != ".safetensors" and path.name != INDEX_FILE:
            shutil.copy2(path, dst_dir / path.name)
    return dst_dir


_MODEL_CLASSES: dict[str, type[PreTrainedModel]] = {
    "qwen3_moe": Qwen3MoeForCausalLM,
    "deepseek_v2": DeepseekV2ForCausalLM,
    "deepseek_v3": DeepseekV3ForCausalLM,
    "mixtral": MixtralForCausalLM,
}


def _num_experts(config: PretrainedConfig) -> int:
    if config.model_type in ("deepseek_v2", "deepseek_v3"):
        return config.n_routed_experts
    return config.num_local_experts


@torch.no_grad()
def _init_weights(model: PreTrainedModel, rng: torch.Generator) -> None:
    """Draw every parameter (and the V3 score bias) from `rng`, in name order."""
    for name, param in sorted(model.named_parameters()):
        if param.ndim == 1:  # RMSNorm weights: the tiny families have no biases
            values = 1.0 + NORM_JITTER * torch.randn(param.shape, generator=rng)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(param.shape, generator=rng)
        else:
            gain = 1.0
            if name == "lm_head.weight":
                gain = LM_HEAD_GAIN
            elif name.endswith("gate.weight"):
                gain = ROUTER_GAIN
            # Linear [out, in] and stacked experts [experts, out, in]: fan_in is the last dim.
            std = gain / math.sqrt(param.shape[-1])
            values = std * torch.randn(param.shape, generator=rng)
        param.copy_(values.to(param.dtype))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(SCORE_BIAS_STD * torch.randn(buffer.shape, generator=rng))


def _hash_table(vocab: int, experts: int, top_k: int, rng: torch.Generator) -> torch.Tensor:
    """[vocab, top_k] int64: each row is `top_k` distinct expert ids, a random draw per token."""
    return torch.rand(vocab, experts, generator=rng).argsort(dim=1)[:, :top_k].contiguous()


def _read_weights(src_dir: Path) -> dict[str, torch.Tensor]:
    index_path = src_dir / INDEX_FILE
    if index_path.exists():
        weight_map: dict[str, str] = json.loads(index_path.read_text())["weight_map"]
        weights: dict[str, torch.Tensor] = {}
        for file_name in sorted(set(weight_map.values())):
            weights.update(load_file(src_dir / file_name))
        return weights
    if (src_dir / WEIGHTS_FILE).exists():
        return load_file(src_dir / WEIGHTS_FILE)
    raise FileNotFoundError(
        f"src_dir={str(src_dir)!r} holds neither {WEIGHTS_FILE} nor {INDEX_FILE}"
    )


def _update_json(path: Path, entries: dict[str, object]) -> None:
    payload = json.loads(path.read_text(encoding="utf-8"))
    payload.update(entries)
    path.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n", encoding="utf-8")
