"""gpt-oss's config.json -> afdserve's ModelConfig plus a GptOssConfig (what only its modules read).

Every key is honoured, ignored for a stated reason (training-only, metadata, or a field
transformers' GptOss classes do not read either), or refused by name, so a checkpoint that says
something this code does not do never loads as if it said something else.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from afdserve.model.config import ModelConfig, common_fields
from afdserve.model.families.decoder.config import _rope, _rope_frequencies
from afdserve.model.quantization import parse_quantization_config

MODEL_TYPES = ("gpt_oss",)
ARCHITECTURES = {"GptOssForCausalLM": "gpt_oss"}
ATTENTION_TYPES = ("sliding_attention", "full_attention")


@dataclass(frozen=True)
class GptOssConfig:
    """The attention side's layer kinds and the experts' SwiGLU gain."""

    attention_types: tuple[str, ...]  # per layer: sliding_attention | full_attention
    sliding_window: int  # keys a sliding layer's query sees, itself included
    swiglu_alpha: float  # gate * sigmoid(alpha * gate)

    def window(self, layer: int) -> int | None:
        return self.sliding_window if self.attention_types[layer] == "sliding_attention" else None

    @property
    def sliding_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.attention_types) if k == "sliding_attention")

    @property
    def full_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.attention_types) if k == "full_attention")


HONOURED = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "attention_bias",
        "layer_types",
        "sliding_window",
        "max_position_embeddings",
        "rms_norm_eps",
        "rope_theta",
        "rope_scaling",
        "rope_parameters",
        "num_local_experts",
        "num_experts",  # transformers' alias of num_local_experts
        "num_experts_per_tok",
        "experts_per_token",  # OpenAI's spelling, kept in the published config.json
        "swiglu_limit",
        "swiglu_alpha",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
        "torch_dtype",
        "dtype",
        # MXFP4 routed experts (model/families/gpt_oss/quant.py).
        "quantization_config",
    }
)
IGNORED = frozenset(
    {
        # metadata
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        # training only
        "initializer_range",
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "use_cache",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        # HF's batched forward pads with it; afdserve's pad rows carry id -1 and are dropped.
        "pad_token_id",
        # transformers' GptOssExperts applies its clamped SwiGLU whatever hidden_act says.
        "hidden_act",
        # OpenAI's pre-YaRN context: the rope reads original_max_position_embeddings instead,
        # as transformers does.
        "initial_context_length",
    }
)


def _check_keys(raw: dict[str, Any]) -> None:
    unknown = sorted(k for k in raw if k not in HONOURED and k not in IGNORED)
    if unknown:
        raise ValueError(
            f"gpt_oss config field {unknown[0]!r} is not supported"
            + (f" (nor {unknown[1:]})" if len(unknown) > 1 else "")
        )


def _attention_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    declared = raw.get("layer_types")
    if declared is None:  # transformers' default: sliding first, then alternating
        return tuple(ATTENTION_TYPES[i % 2] for i in range(layers))
    # More entries than layers: a preset's first layers (model/presets.py's NAME:LAYERS).
    if len(declared) < layers:
        raise ValueError(f"layer_types has {len(declared)} entries, num_hidden_layers={layers}")
    declared = declared[:layers]
    for i, kind in enumerate(declared):
        if kind not in ATTENTION_TYPES:
            raise ValueError(f"layer_types[{i}]={kind!r}: one of {ATTENTION_TYPES}")
    return tuple(declared)


def _top_k(raw: dict[str, Any]) -> int:
    top_k = raw.get("num_experts_per_tok", raw.get("experts_per_token"))
    other = raw.get("experts_per_token", top_k)
    if top_k is None or other != top_k:
        raise ValueError(
            f"num_experts_per_tok={raw.get('num_experts_per_tok')!r} and experts_per_token="
            f"{raw.get('experts_per_token')!r}: give one, or both equal"
        )
    return int(top_k)


def _window(raw: dict[str, Any], kinds: tuple[str, ...]) -> int:
    window = raw.get("sliding_window")
    if "sliding_attention" in kinds and (window is None or int(window) < 1):
        raise ValueError(f"sliding_window={window!r}: the sliding layers need a positive width")
    return int(window or 0)


def parse_gpt_oss_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    _check_keys(raw)
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    kinds = _attention_types(raw, layers)
    rope_theta, rope_params = _rope(raw)
    # transformers' config (which computes the rope) wants a layer type per layer, no more.
    as_parsed = {**raw, "layer_types": list(kinds)}
    inv_freq, rope_scaling = _rope_frequencies(as_parsed, rope_theta, rope_params, head_dim)
    experts = int(raw.get("num_local_experts") or raw.get("num_experts"))
    inter = int(raw["intermediate_size"])
    return ModelConfig(
        family="gpt_oss",
        **common_fields(raw, 1e-5, 131072),
        attention="gqa",
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        qk_norm=False,
        attention_bias=bool(raw.get("attention_bias", True)),
        rope_inv_freq=inv_freq,
        rope_attention_scaling=rope_scaling,
        rope_interleave=False,
        q_lora_rank=None,
        kv_lora_rank=0,
        qk_nope_head_dim=0,
        qk_rope_head_dim=0,
        v_head_dim=head_dim,
        softmax_scale=head_dim**-0.5,
        layer_types=("moe",) * layers,
        intermediate_size=inter,
        moe_intermediate_size=inter,
        num_experts=experts,
        top_k=_top_k(raw),
        n_shared_experts=0,
        # Top-k of the router's logits, then a softmax over those k (gpt_oss/model.py's router).
        scoring="softmax",
        topk_method="greedy",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=1.0,
        hidden_act="silu",
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantization=parse_quantization_config(raw, mxfp4_experts=True),
        swiglu_limit=float(raw.get("swiglu_limit", 7.0)),
        family_config=GptOssConfig(
            attention_types=kinds,
            sliding_window=_window(raw, kinds),
            swiglu_alpha=float(raw.get("swiglu_alpha", 1.702)),
        ),
    )
