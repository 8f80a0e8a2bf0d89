"""A tiny DeepSeek-V4 checkpoint, written by transformers' own `DeepseekV4ForCausalLM`.

Small enough for a CPU test, and shaped so that every V4 mechanism is exercised by short
prompts: all three attention types, a sliding window of 4, compression rates 2 (CSA) and 4 (HCA),
an indexer that keeps 2 entries of the several that close, 2 mHC streams, a hash-routed first
layer, and a SwiGLU clamp low enough that activations hit it. The indexer has 8 heads: with 2,
relu often zeroes all of them and entries tie at score 0.0, where the kept entry is torch.topk's
shape-dependent choice in transformers (tests/model/deepseek_v4_helpers.py).
`save_pretrained` writes the public tensor names (`layers.N.attn.wq_a.weight`,
`...ffn.experts.E.w1.weight`, `hc_head_fn`), the ones real checkpoints use, so loading it
exercises afdserve's name mapping.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch
from transformers import DeepseekV4Config, DeepseekV4ForCausalLM, GenerationConfig

from afdserve.model.byte_tokenizer import BOS_ID, EOS_ID, PAD_ID, VOCAB_SIZE, build_byte_tokenizer

TINY_V4 = {
    "vocab_size": VOCAB_SIZE, "hidden_size": 32, "moe_intermediate_size": 16,
    "num_hidden_layers": 4, "num_attention_heads": 4, "num_key_value_heads": 1, "head_dim": 16,
    "q_lora_rank": 16, "partial_rotary_factor": 0.5, "n_routed_experts": 4,
    "num_experts_per_tok": 2, "n_shared_experts": 1, "scoring_func": "sqrtsoftplus",
    "routed_scaling_factor": 1.5, "max_position_embeddings": 512,
    "layer_types": ["sliding_attention", "compressed_sparse_attention",
                    "heavily_compressed_attention", "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "moe"],
    "compress_rates": {"compressed_sparse_attention": 2, "heavily_compressed_attention": 4},
    "hc_mult": 2, "hc_sinkhorn_iters": 20, "sliding_window": 4, "o_groups": 2, "o_lora_rank": 8,
    "index_n_heads": 8, "index_head_dim": 8, "index_topk": 2, "swiglu_limit": 1.5,
    "tie_word_embeddings": False, "bos_token_id": BOS_ID, "eos_token_id": EOS_ID,
    "pad_token_id": PAD_ID, "num_nextn_predict_layers": 0,
}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
# As model/tiny.py (whose docstring says why): unit-scale activations, logits spread by units.
LM_HEAD_GAIN, ROUTER_GAIN, NORM_JITTER, SCORE_BIAS_STD = 3.0, 2.0, 0.1, 0.05


def tiny_v4_config(**overrides: object) -> DeepseekV4Config:
    return DeepseekV4Config(**{**TINY_V4, **overrides})


def build_tiny_v4(seed: int = 0, dtype: str = "float32", **overrides: object
                  ) -> DeepseekV4ForCausalLM:
    """The in-memory transformers model (eager attention, the only one V4 has), deterministic in
    (seed, dtype, overrides)."""
    config = tiny_v4_config(**overrides)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).eval()
    rng = torch.Generator().manual_seed(2 * seed)
    _init_weights(model, rng, torch.Generator().manual_seed(2 * seed + 1))
    model.to(DTYPES[dtype])
    model.generation_config = GenerationConfig(
        bos_token_id=BOS_ID, eos_token_id=EOS_ID, pad_token_id=PAD_ID, do_sample=False)
    return model


def make_tiny_v4(out_dir: str | Path, seed: int = 0, dtype: str = "float32",
                 **overrides: object) -> Path:
    out_dir = Path(out_dir)
    if out_dir.exists() and any(out_dir.iterdir()):
        raise FileExistsError(f"out_dir={str(out_dir)!r} is not empty; give a new or empty folder")
    build_tiny_v4(seed, dtype, **overrides).save_pretrained(out_dir, safe_serialization=True)
    build_byte_tokenizer(out_dir)
    return out_dir


@torch.no_grad()
def _init_weights(model: DeepseekV4ForCausalLM, rng: torch.Generator,
                  tables: torch.Generator) -> None:
    """Every parameter random, in name order: matrices std gain / sqrt(fan_in), vectors around 1
    (sinks, mHC's base and scale too: transformers starts those at 0 or 1, which would leave
    their code paths untested); hash tables of distinct random experts per token."""
    for name, param in sorted(model.named_parameters()):
        if param.ndim == 1:
            values = 1.0 + NORM_JITTER * torch.randn(param.shape, generator=rng)
        elif name.endswith("embed_tokens.weight"):
            values = torch.randn(param.shape, generator=rng)
        else:
            gain = LM_HEAD_GAIN if name == "lm_head.weight" else (
                ROUTER_GAIN if name.endswith("gate.weight") else 1.0)
            values = gain / math.sqrt(param.shape[-1]) * torch.randn(param.shape, generator=rng)
        param.copy_(values.to(param.dtype))
    experts, k = model.config.n_routed_experts, model.config.num_experts_per_tok
    for name, buffer in sorted(model.named_buffers()):
        if name.endswith("e_score_correction_bias"):
            buffer.copy_(SCORE_BIAS_STD * torch.randn(buffer.shape, generator=rng))
        elif name.endswith("tid2eid"):
            keys = torch.rand(buffer.shape[0], experts, generator=tables)
            buffer.copy_(keys.argsort(dim=1)[:, :k])
