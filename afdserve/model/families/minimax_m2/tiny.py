"""A tiny random MiniMax-M2 checkpoint (`afdserve make-tiny-model --family minimax_m2`), written by
transformers' own MiniMaxM2ForCausalLM in the public layout (`block_sparse_moe`, experts one by
one as w1/w2/w3, the selection bias beside the gate), plus one multi-token-prediction module's
tensors after the last layer (`model.layers.{N}.*`, as MiniMax publishes them with
`num_mtp_modules`), which neither transformers nor afdserve builds. Quantized, it takes
MiniMax-M2's FP8 spelling: 128 x 128 block scales, `fmt: float8_e4m3fn`, router, bias and
lm_head unconverted. Weights as model/fixtures/tiny.py draws them (std gain / sqrt(fan_in)), so
logits spread and routers differ by token."""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import GenerationConfig, MiniMaxM2Config, MiniMaxM2ForCausalLM

from afdserve.model.fixtures.byte_tokenizer import (
    BOS_ID,
    EOS_ID,
    PAD_ID,
    VOCAB_SIZE,
    build_byte_tokenizer,
)
from afdserve.model.fixtures.fp8_checkpoint import quantize_checkpoint
from afdserve.model.fixtures.seeded import DTYPES, empty_out_dir

TINY = dict(
    vocab_size=VOCAB_SIZE,
    hidden_size=64,
    intermediate_size=32,
    num_hidden_layers=3,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    rotary_dim=8,  # partial rotary: half of each head, as the published 64 of 128
    rope_theta=10000.0,
    num_local_experts=8,
    num_experts_per_tok=2,
    max_position_embeddings=512,
    bos_token_id=BOS_ID,
    eos_token_id=EOS_ID,
    pad_token_id=PAD_ID,
    num_mtp_modules=1,
    use_mtp=True,
)
# What MiniMax-M2's quantization_config leaves unconverted.
NOT_CONVERTED = ("gate", "e_score_correction_bias", "lm_head")
# Gains of the random init (model/fixtures/tiny.py's), and the selection bias's spread.
LM_HEAD_GAIN, ROUTER_GAIN, NORM_JITTER, SCORE_BIAS_STD = 3.0, 2.0, 0.1, 0.05
WEIGHTS_FILE = "model.safetensors"


def tiny_config(**overrides: object) -> MiniMaxM2Config:
    return MiniMaxM2Config(**{**TINY, **overrides})


@torch.no_grad()
def _init_weights(model: MiniMaxM2ForCausalLM, rng: torch.Generator) -> None:
    for name, param in sorted(model.named_parameters()):
        if param.ndim == 1:  # norms
            values = 1.0 + NORM_JITTER * torch.randn(param.shape, generator=rng)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(param.shape, generator=rng)
        else:
            gain = LM_HEAD_GAIN if name == "lm_head.weight" else 1.0
            gain = ROUTER_GAIN if name.endswith("gate.weight") else gain
            values = gain / math.sqrt(param.shape[-1]) * torch.randn(param.shape, generator=rng)
        param.copy_(values.to(param.dtype))
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(SCORE_BIAS_STD * torch.randn(buffer.shape, generator=rng))


def _mtp_tensors(config: MiniMaxM2Config, rng: torch.Generator) -> dict[str, torch.Tensor]:
    """Some of an MTP module's tensors, named as the checkpoint names them (after the last
    layer): enough for a loader to show it skips them by name."""
    prefix = f"model.layers.{config.num_hidden_layers}"
    hidden, q = config.hidden_size, config.num_attention_heads * config.head_dim
    return {
        f"{prefix}.input_layernorm.weight": torch.ones(hidden),
        f"{prefix}.self_attn.q_proj.weight": torch.randn(q, hidden, generator=rng) / hidden**0.5,
    }


def make_tiny_minimax_m2(
    out_dir: str | Path,
    model_type: str = "minimax_m2",
    hash_layers: int = 0,
    seed: int = 0,
    dtype: str = "float32",
    quantization: str | None = None,
    **overrides: object,
) -> Path:
    """Write the checkpoint into `out_dir` (new or empty); `overrides`: config fields."""
    if hash_layers:
        raise ValueError(f"hash_layers={hash_layers}: MiniMax-M2 has no hash-routed layers; 0")
    if dtype not in DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; allowed: {tuple(DTYPES)}")
    if quantization not in (None, "fp8"):
        raise ValueError(f"quantization={quantization!r} is not supported; allowed: None, 'fp8'")
    out_dir = empty_out_dir(out_dir)
    config = tiny_config(**overrides)
    torch.manual_seed(seed)
    model = MiniMaxM2ForCausalLM(config).eval()
    rng = torch.Generator().manual_seed(2 * seed)
    _init_weights(model, rng)
    model.to(DTYPES[dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False
    )
    model.save_pretrained(out_dir, safe_serialization=True)
    if config.use_mtp and config.num_mtp_modules:
        weights = load_file(out_dir / WEIGHTS_FILE)
        extra = _mtp_tensors(config, rng)
        weights.update({k: v.to(DTYPES[dtype]) for k, v in extra.items()})
        save_file(weights, out_dir / WEIGHTS_FILE, metadata={"format": "pt"})
    if quantization == "fp8":
        quantize_checkpoint(out_dir, NOT_CONVERTED)
        path = out_dir / "config.json"
        raw = json.loads(path.read_text(encoding="utf-8"))
        raw["quantization_config"]["fmt"] = "float8_e4m3fn"  # MiniMax-M2's spelling
        path.write_text(json.dumps(raw, indent=2, sort_keys=True) + "\n", encoding="utf-8")
    build_byte_tokenizer(out_dir)
    return out_dir
