"""config.json -> ModelConfig for the families that share the decoder of model.py: Qwen3-MoE
(GQA, q/k norm), Mixtral, DeepSeek-V2 and V3 (MLA, grouped top-k, shared experts)."""

from __future__ import annotations

import math
from typing import Any

from afdserve.model.config import ModelConfig, common_fields
from afdserve.model.quantization import parse_quantization_config

MODEL_TYPES = ("qwen3_moe", "deepseek_v2", "deepseek_v3", "mixtral")
ARCHITECTURES = {
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "MixtralForCausalLM": "mixtral",
}


def _layer_types(raw: dict[str, Any], family: str, num_layers: int) -> tuple[str, ...]:
    if family == "qwen3_moe":
        sparse_step = raw.get("decoder_sparse_step", 1) or 1
        dense_only = set(raw.get("mlp_only_layers") or ())
        base = [
            "dense" if i in dense_only or (i + 1) % sparse_step else "moe"
            for i in range(num_layers)
        ]
    elif family in ("deepseek_v2", "deepseek_v3"):
        first_dense = raw.get("first_k_dense_replace", 0) or 0
        base = ["dense" if i < first_dense else "moe" for i in range(num_layers)]
    else:
        base = ["moe"] * num_layers
    declared = raw.get("mlp_layer_types")
    if declared is not None:
        declared = tuple(declared)
        if len(declared) != num_layers:
            raise ValueError(
                f"mlp_layer_types has {len(declared)} entries, num_hidden_layers={num_layers}"
            )
        for i, (want, have) in enumerate(zip(declared, base)):
            if (want == "dense") != (have == "dense"):
                raise ValueError(
                    f"mlp_layer_types[{i}]={want!r} contradicts the family's dense-layer rule "
                    f"(layer {i} is {have!r})"
                )
        return declared
    num_hash = raw.get("num_hash_layers", 0) or 0
    out, left = [], num_hash
    for kind in base:
        if kind == "moe" and left > 0:
            out.append("hash_moe")
            left -= 1
        else:
            out.append(kind)
    return tuple(out)


def _rope(raw: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    params = raw.get("rope_parameters") or raw.get("rope_scaling")
    theta = raw.get("rope_theta")
    if isinstance(params, dict):
        theta = params.get("rope_theta", theta)
        kind = params.get("rope_type", params.get("type", "default"))
        if kind == "default":
            params = None
    else:
        params = None
    return float(theta if theta is not None else 10000.0), params


def _rope_frequencies(
    raw: dict[str, Any], theta: float, params: dict[str, Any] | None, dim: int
) -> tuple[tuple[float, ...], float]:
    """Inverse frequencies and cos/sin scaling. Scaled variants (yarn, ...) use transformers' own
    definitions so a real checkpoint's positions mean what its authors meant."""
    if params is None:
        import torch

        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return tuple(inv.tolist()), 1.0
    from transformers import AutoConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    hf = AutoConfig.for_model(**raw)
    kind = params.get("rope_type", params.get("type"))
    if kind not in ROPE_INIT_FUNCTIONS:
        raise ValueError(
            f"rope type {kind!r} is not supported: one of {sorted(ROPE_INIT_FUNCTIONS)}"
        )
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu")
    if inv_freq.numel() * 2 != dim:
        raise ValueError(f"rope {kind!r} gave {inv_freq.numel()} frequencies for rotary dim {dim}")
    return tuple(inv_freq.tolist()), float(scaling)


def _yarn_mscale(scale: float, mscale: float) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def parse_decoder_config(raw: dict[str, Any], family: str) -> ModelConfig:
    num_layers = int(raw["num_hidden_layers"])
    hidden = int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    rope_theta, rope_params = _rope(raw)
    mla = family in ("deepseek_v2", "deepseek_v3")
    if mla:
        nope, rope_dim = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
        head_dim = nope + rope_dim
        scale = head_dim**-0.5
        if rope_params and rope_params.get("mscale_all_dim"):
            m = _yarn_mscale(rope_params["factor"], rope_params["mscale_all_dim"])
            scale *= m * m
    else:
        nope, rope_dim = 0, 0
        head_dim = int(raw.get("head_dim") or hidden // heads)
        scale = head_dim**-0.5
    if family == "mixtral":
        num_experts = int(raw["num_local_experts"])
    elif mla:
        num_experts = int(raw["n_routed_experts"])
    else:
        num_experts = int(raw.get("num_experts") or raw.get("num_local_experts"))
    topk_method = raw.get("topk_method") or ("noaux_tc" if family == "deepseek_v3" else "greedy")
    scoring = raw.get("scoring_func") or ("sigmoid" if family == "deepseek_v3" else "softmax")
    inv_freq, rope_scaling = _rope_frequencies(raw, rope_theta, rope_params, rope_dim or head_dim)
    return ModelConfig(
        family=family,
        **common_fields(raw, 1e-6, 4096),
        attention="mla" if mla else "gqa",
        num_heads=heads,
        num_kv_heads=heads if mla else int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        qk_norm=family == "qwen3_moe",
        attention_bias=bool(raw.get("attention_bias", False)),
        rope_inv_freq=inv_freq,
        rope_attention_scaling=rope_scaling,
        # DeepSeek rotates interleaved pairs (x0, x1), (x2, x3), ...; Qwen, Mixtral rotate halves.
        rope_interleave=mla,
        q_lora_rank=raw.get("q_lora_rank") if mla else None,
        kv_lora_rank=int(raw.get("kv_lora_rank") or 0) if mla else 0,
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope_dim,
        v_head_dim=int(raw["v_head_dim"]) if mla else head_dim,
        softmax_scale=scale,
        layer_types=_layer_types(raw, family, num_layers),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        moe_intermediate_size=int(
            raw.get("moe_intermediate_size") or raw.get("intermediate_size") or 0
        ),
        num_experts=num_experts,
        top_k=int(raw["num_experts_per_tok"]),
        n_shared_experts=int(raw.get("n_shared_experts") or 0) if mla else 0,
        scoring=scoring,
        topk_method=topk_method,
        n_group=int(raw.get("n_group") or 1),
        topk_group=int(raw.get("topk_group") or 1),
        norm_topk_prob=True if family == "mixtral" else bool(raw.get("norm_topk_prob", False)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0) or 1.0) if mla else 1.0,
        hidden_act=raw.get("hidden_act", "silu"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantization=parse_quantization_config(raw),
    )
