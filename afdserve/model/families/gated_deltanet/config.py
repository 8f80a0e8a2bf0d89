"""config.json -> ModelConfig for the Gated DeltaNet hybrids: Qwen3-Next (`qwen3_next`) and
Qwen3.5-MoE (`qwen3_5_moe`, the image-text checkpoint served text-only, and `qwen3_5_moe_text`).

Every field is honoured, ignored by name (training-only, or the vision tower's), or refused by
name with what is allowed.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from afdserve.model.config import ModelConfig, common_fields, refuse_unknown_fields
from afdserve.model.quantization import parse_quantization_config

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "qwen3_5_moe_text")
ARCHITECTURES = {
    "Qwen3NextForCausalLM": "qwen3_next",
    "Qwen3_5MoeForConditionalGeneration": "qwen3_5_moe",
    "Qwen3_5MoeForCausalLM": "qwen3_5_moe_text",
}
LINEAR, FULL = "linear_attention", "full_attention"
# Read by training or generation only; nothing the forward computes depends on them.
TRAINING_ONLY = (
    "initializer_range",
    "output_router_logits",
    "router_aux_loss_coef",
    "attention_dropout",
    "use_cache",
    "pad_token_id",
    "mtp_num_hidden_layers",  # the multi-token-prediction head: its `mtp.*` tensors are skipped
    "mtp_use_dedicated_embeddings",
)
# The text model's fields parse_gdn_config reads (the values it cannot honour are refused in
# _refuse and _rope).
HONOURED = frozenset(
    {
        *("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "eos_token_id"),
        *("tie_word_embeddings", "max_position_embeddings", "bos_token_id", "hidden_act"),
        *("use_sliding_window", "attn_output_gate", "num_experts", "num_experts_per_tok"),
        *("rope_parameters", "rope_scaling", "rope_theta", "partial_rotary_factor"),
        *("layer_types", "full_attention_interval", "decoder_sparse_step", "mlp_only_layers"),
        *("num_attention_heads", "num_key_value_heads", "head_dim", "attention_bias"),
        *("linear_num_key_heads", "linear_num_value_heads", "linear_key_head_dim"),
        *("linear_value_head_dim", "linear_conv_kernel_dim", "shared_expert_intermediate_size"),
        *("intermediate_size", "moe_intermediate_size", "norm_topk_prob", "quantization_config"),
        # The recurrent state's dtype: afdserve keeps it float32 (checked in _refuse).
        "mamba_ssm_dtype",
        # Read only with use_sliding_window, which is refused.
        *("sliding_window", "max_window_layers"),
    }
)
# The image-text checkpoint's own keys: text-only serving reads none of them.
VISION_ONLY = (
    "vision_config",
    "image_token_id",
    "video_token_id",
    "vision_start_token_id",
    "vision_end_token_id",
)


@dataclass(frozen=True)
class GDNConfig:
    """What only this family's modules read (`ModelConfig.family_config`)."""

    attention_types: tuple[str, ...]  # per layer: linear_attention | full_attention
    # qwen3_next: one in_proj_qkvz and one in_proj_ba, grouped per key head; qwen3_5: separate
    # in_proj_qkv, in_proj_z, in_proj_b, in_proj_a, each laid out head after head.
    packed_projections: bool
    num_key_heads: int
    num_value_heads: int
    key_head_dim: int
    value_head_dim: int
    conv_kernel: int
    rotary_dim: int
    shared_expert_intermediate_size: int
    # The checkpoint's name of our `model.` (the image-text checkpoint nests the text model).
    checkpoint_prefix: str = "model."

    def __post_init__(self) -> None:
        bad = sorted({t for t in self.attention_types if t not in (LINEAR, FULL)})
        if bad:
            raise ValueError(f"layer_types holds {bad}: each must be {LINEAR!r} or {FULL!r}")
        if self.num_value_heads % self.num_key_heads:
            raise ValueError(
                f"linear_num_value_heads={self.num_value_heads} must be a multiple of "
                f"linear_num_key_heads={self.num_key_heads}"
            )
        if self.conv_kernel < 1:
            raise ValueError(f"linear_conv_kernel_dim={self.conv_kernel}: must be >= 1")

    @property
    def conv_dim(self) -> int:
        """Channels of the short convolution: q, k and v of every head."""
        return 2 * self.num_key_heads * self.key_head_dim + self.value_dim

    @property
    def value_dim(self) -> int:
        return self.num_value_heads * self.value_head_dim

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attention_types) if t == kind)


def _text_config(raw: dict[str, Any], model_type: str) -> tuple[dict[str, Any], str]:
    """The text model's fields, and the checkpoint's name of its `model.`."""
    if model_type != "qwen3_5_moe":
        return raw, "model."
    outer = {"text_config", "tie_word_embeddings", "eos_token_id", "bos_token_id", *VISION_ONLY}
    refuse_unknown_fields(raw, frozenset(outer), "qwen3_5_moe config")
    if not isinstance(raw.get("text_config"), dict):
        raise ValueError("qwen3_5_moe config.json: text_config is missing (the text model's)")
    text = dict(raw["text_config"])
    for key in ("tie_word_embeddings", "eos_token_id", "bos_token_id"):
        if key in raw and key not in text:
            text[key] = raw[key]
    return text, "model.language_model."


def _refuse(raw: dict[str, Any]) -> None:
    refuse_unknown_fields(raw, HONOURED | set(TRAINING_ONLY), "Gated DeltaNet text config")
    if raw.get("mamba_ssm_dtype", "float32") != "float32":
        raise ValueError(
            f"mamba_ssm_dtype={raw['mamba_ssm_dtype']!r}: only 'float32' (the recurrent state "
            "is kept in float32)"
        )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={raw['hidden_act']!r}: only 'silu' is supported")
    if raw.get("use_sliding_window"):
        raise ValueError("use_sliding_window=True is not supported: only false")
    if raw.get("attn_output_gate", True) is not True:
        raise ValueError("attn_output_gate=False is not supported: only true (gated attention)")
    if not raw.get("num_experts"):
        raise ValueError("num_experts=0 is not supported: the FFN ranks serve an MoE")


def _rope(raw: dict[str, Any], head_dim: int) -> tuple[tuple[float, ...], int]:
    """Inverse frequencies of the rotated part and its width (partial_rotary_factor of head_dim).
    Only the default rope: text-only positions make Qwen3.5's interleaved mrope the same rope."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    kind = params.get("rope_type", params.get("type", "default"))
    if kind != "default":
        raise ValueError(f"rope_type={kind!r} is not supported for this family: only 'default'")
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    factor = params.get("partial_rotary_factor", raw.get("partial_rotary_factor", 0.25))
    dim = int(head_dim * factor)
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
    return tuple(inv.tolist()), dim


def _attention_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    declared = raw.get("layer_types")
    if declared is None:
        every = int(raw.get("full_attention_interval", 4))
        return tuple(LINEAR if (i + 1) % every else FULL for i in range(layers))
    # A published list stays whole when a bench keeps only the first layers (model/presets.py).
    if len(declared) < layers:
        raise ValueError(f"layer_types has {len(declared)} entries, num_hidden_layers={layers}")
    return tuple(declared[:layers])


def _mlp_types(raw: dict[str, Any], model_type: str, layers: int) -> tuple[str, ...]:
    if model_type != "qwen3_next":  # Qwen3.5-MoE: every layer is MoE
        return ("moe",) * layers
    step = raw.get("decoder_sparse_step", 1) or 1
    dense = set(raw.get("mlp_only_layers") or ())
    return tuple("dense" if i in dense or (i + 1) % step else "moe" for i in range(layers))


def parse_gdn_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    text, prefix = _text_config(raw, model_type)
    _refuse(text)
    layers, hidden = int(text["num_hidden_layers"]), int(text["hidden_size"])
    heads = int(text["num_attention_heads"])
    head_dim = int(text.get("head_dim") or hidden // heads)
    inv_freq, rotary_dim = _rope(text, head_dim)
    gdn = GDNConfig(
        attention_types=_attention_types(text, layers),
        packed_projections=model_type == "qwen3_next",
        num_key_heads=int(text.get("linear_num_key_heads", 16)),
        num_value_heads=int(text.get("linear_num_value_heads", 32)),
        key_head_dim=int(text.get("linear_key_head_dim", 128)),
        value_head_dim=int(text.get("linear_value_head_dim", 128)),
        conv_kernel=int(text.get("linear_conv_kernel_dim", 4)),
        rotary_dim=rotary_dim,
        shared_expert_intermediate_size=int(text.get("shared_expert_intermediate_size") or 0),
        checkpoint_prefix=prefix,
    )
    return ModelConfig(
        family=model_type,
        **common_fields(text, 1e-6, 32768),
        attention="gqa",
        num_heads=heads,
        num_kv_heads=int(text.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        qk_norm=True,
        attention_bias=bool(text.get("attention_bias", False)),
        rope_inv_freq=inv_freq,
        rope_attention_scaling=1.0,
        rope_interleave=False,
        q_lora_rank=None,
        kv_lora_rank=0,
        qk_nope_head_dim=0,
        qk_rope_head_dim=0,
        v_head_dim=head_dim,
        softmax_scale=head_dim**-0.5,
        layer_types=_mlp_types(text, model_type, layers),
        intermediate_size=int(text.get("intermediate_size") or 0),
        moe_intermediate_size=int(text["moe_intermediate_size"]),
        num_experts=int(text["num_experts"]),
        top_k=int(text["num_experts_per_tok"]),
        n_shared_experts=0,  # the gated shared expert is the family's own (model.py)
        scoring="softmax",
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        # Qwen3.5-MoE's router always renormalises its top-k.
        norm_topk_prob=model_type != "qwen3_next" or bool(text.get("norm_topk_prob", True)),
        routed_scaling_factor=1.0,
        hidden_act="silu",
        torch_dtype=text.get("torch_dtype") or text.get("dtype") or raw.get("torch_dtype"),
        quantization=_no_quantization(raw),
        family_config=gdn,
    )


def _no_quantization(raw: dict[str, Any]) -> None:
    if parse_quantization_config(raw) is not None:
        raise ValueError(
            "quantization_config is not supported for the Gated DeltaNet families yet: serve "
            "the bf16 checkpoint"
        )
    return None
