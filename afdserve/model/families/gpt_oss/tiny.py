"""Tiny random gpt-oss checkpoints (`afdserve make-tiny-model --family gpt_oss [--quantization
mxfp4]`), written by transformers' own GptOssForCausalLM (the parity tests' oracle), in the
published layouts: stacked experts in bf16/float32, or MXFP4 (`..._blocks`, `..._scales`).

Small enough for a CPU, yet every gpt-oss path matters: YaRN rope, a window (8) shorter than the
tests' prompts, sinks and biases drawn large enough to move tokens, and a SwiGLU clamp (1.0, the
published 7.0 would never bind at these scales) that binds on many entries. Weights get std
gain / sqrt(fan_in) (as model/fixtures/tiny.py's families, whose reasons hold here).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch

from afdserve.kernels.ops import quantize_fp4
from afdserve.model.fixtures.seeded import DTYPES, empty_out_dir

# The byte tokenizer's ids (model/fixtures/byte_tokenizer.py, which tiny.py writes beside this
# checkpoint; the families may not import fixtures): 256 bytes, then bos, eos, pad, turn start.
VOCAB_SIZE, BOS_ID, EOS_ID, PAD_ID = 260, 256, 257, 258
WEIGHTS_FILE = "model.safetensors"

TINY_GPT_OSS = {
    "vocab_size": VOCAB_SIZE,
    "hidden_size": 64,
    "intermediate_size": 64,  # a multiple of 64: the FP4 kernels take it (fp4_decode.MIN_K_BLOCK)
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "num_local_experts": 4,
    "num_experts_per_tok": 2,
    "sliding_window": 8,
    "layer_types": ["sliding_attention", "full_attention"] * 2,
    "max_position_embeddings": 512,
    "rope_parameters": {
        "rope_type": "yarn",
        "rope_theta": 150000.0,
        "factor": 4.0,
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "truncate": False,
        "original_max_position_embeddings": 128,
    },
    "swiglu_limit": 1.0,
    "attention_bias": True,
    "tie_word_embeddings": False,
    "bos_token_id": BOS_ID,
    "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID,
}
# Stds of the tensors without a fan-in: sinks of unit scale move the softmax; biases move less.
SINK_STD, BIAS_STD, NORM_JITTER, ROUTER_GAIN, LM_HEAD_GAIN = 1.0, 0.3, 0.1, 2.0, 3.0
MXFP4_SKIPPED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens"]


def _std(name: str, param: torch.Tensor) -> float:
    if name.endswith("sinks"):
        return SINK_STD
    if name.endswith("bias"):
        return BIAS_STD
    gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
    gain = ROUTER_GAIN if name.endswith("router.weight") else gain
    # transformers' experts are [E, in, out]; linear weights [out, in].
    fan_in = param.shape[1] if name.endswith(("gate_up_proj", "down_proj")) else param.shape[-1]
    return gain / math.sqrt(fan_in)


@torch.no_grad()
def build_tiny_gpt_oss(seed: int = 0, dtype: str = "float32"):
    """transformers' GptOssForCausalLM at the tiny shape, weights drawn from `seed`."""
    from transformers import GenerationConfig, GptOssConfig, GptOssForCausalLM

    torch.manual_seed(seed)
    model = GptOssForCausalLM(GptOssConfig(**TINY_GPT_OSS)).eval()
    rng = torch.Generator().manual_seed(2 * seed)
    for name, param in sorted(model.named_parameters()):
        if name.endswith("layernorm.weight") or name == "model.norm.weight":
            values = 1.0 + NORM_JITTER * torch.randn(param.shape, generator=rng)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(param.shape, generator=rng)
        else:
            values = _std(name, param) * torch.randn(param.shape, generator=rng)
        param.copy_(values.to(param.dtype))
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    return model.to(DTYPES[dtype])


def make_tiny_gpt_oss(
    out_dir: str | Path,
    model_type: str = "gpt_oss",
    hash_layers: int = 0,
    seed: int = 0,
    dtype: str = "float32",
    quantization: str | None = None,
) -> Path:
    """Family.make_tiny: the checkpoint and config.json (model/fixtures/tiny.py adds the
    tokenizer). `quantization="mxfp4"`: the experts as the published MXFP4 checkpoints hold them."""
    if hash_layers:
        raise ValueError(f"hash_layers={hash_layers} for gpt_oss (it has none); allowed: 0")
    if quantization not in (None, "mxfp4"):
        raise ValueError(f"quantization={quantization!r} for gpt_oss: allowed None, 'mxfp4'")
    out_dir = empty_out_dir(out_dir)
    build_tiny_gpt_oss(seed, dtype).save_pretrained(out_dir, safe_serialization=True)
    if quantization == "mxfp4":
        write_mxfp4(out_dir)
    return out_dir


def mxfp4_experts(stacked: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """transformers' [E, in, out] expert stack -> (blocks [E, out, in / 32, 16], scales
    [E, out, in / 32]) as MXFP4 checkpoints store them (rows in the published order)."""
    packed, scales = quantize_fp4(stacked.transpose(1, 2).float().contiguous())
    return packed.unflatten(-1, (-1, 16)).contiguous(), scales.contiguous()


def write_mxfp4(model_dir: Path) -> None:
    """Rewrite a tiny checkpoint's expert stacks as MXFP4 and say so in config.json."""
    from safetensors.torch import load_file, save_file

    weights = load_file(model_dir / WEIGHTS_FILE)
    for name in [n for n in weights if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        blocks, scales = mxfp4_experts(weights.pop(name))
        weights[name + "_blocks"], weights[name + "_scales"] = blocks, scales
    save_file(weights, model_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["quantization_config"] = {
        "quant_method": "mxfp4",
        "modules_to_not_convert": [*MXFP4_SKIPPED, "lm_head"],
    }
    config_path.write_text(json.dumps(config, indent=2) + "\n")
