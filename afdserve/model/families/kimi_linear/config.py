"""config.json -> ModelConfig for Kimi-Linear (`kimi_linear`): Kimi Delta Attention layers and
MLA layers without positional encoding (NoPE), a grouped sigmoid router with a score bias and
shared experts. Both spellings of its fields are read (the public config.json's
`num_experts_per_token`, `model_max_length`, `linear_attn_config`, ... and transformers' names);
the rest is honoured, ignored as training-only, or refused by name."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from afdserve.model.config import ModelConfig, refuse_unknown_fields
from afdserve.model.quantization import parse_quantization_config

LINEAR, FULL = "linear_attention", "full_attention"
# The fields parse_kimi_config reads, in both spellings; values it cannot honour are refused in
# _refuse.
HONOURED = frozenset(
    {
        *("vocab_size", "hidden_size", "num_hidden_layers", "rms_norm_eps", "eos_token_id"),
        *("tie_word_embeddings", "max_position_embeddings", "model_max_length", "bos_token_id"),
        *("hidden_act", "quantization_config", "num_attention_heads", "attention_bias"),
        *("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "q_lora_rank", "kv_lora_rank"),
        *("layer_types", "linear_attn_config", "linear_num_heads", "linear_head_dim"),
        *("linear_conv_kernel_dim", "mlp_layer_types", "first_k_dense_replace"),
        *("intermediate_size", "moe_intermediate_size", "num_experts", "num_local_experts"),
        *("num_experts_per_token", "num_experts_per_tok", "num_shared_experts"),
        *("n_shared_experts", "num_expert_group", "n_group", "topk_group", "moe_renormalize"),
        *("norm_topk_prob", "routed_scaling_factor", "use_grouped_topk", "moe_layer_freq"),
        *("moe_router_activation_func", "mla_use_nope"),
        # NoPE MLA reads no rotary settings; MLA's heads are its own (qk_*_head_dim, heads).
        *("rope_theta", "rope_scaling", "rope_parameters", "head_dim", "qk_head_dim"),
        "num_key_value_heads",
        # The multi-token-prediction layers: none built, their tensors skipped at load.
        "num_nextn_predict_layers",
    }
)
LINEAR_ATTN_FIELDS = frozenset(
    {"full_attn_layers", "kda_layers", "num_heads", "head_dim", "short_conv_kernel_size"}
)


@dataclass(frozen=True)
class KimiConfig:
    """What only Kimi-Linear's modules read (`ModelConfig.family_config`)."""

    attention_types: tuple[str, ...]  # per layer: linear_attention | full_attention
    num_heads: int  # of a KDA layer (q, k and v alike)
    head_dim: int
    conv_kernel: int

    def __post_init__(self) -> None:
        bad = sorted({t for t in self.attention_types if t not in (LINEAR, FULL)})
        if bad:
            raise ValueError(f"layer_types holds {bad}: each must be {LINEAR!r} or {FULL!r}")

    @property
    def qkv_dim(self) -> int:
        return self.num_heads * self.head_dim

    def layers_of(self, kind: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.attention_types) if t == kind)


def _pick(raw: dict[str, Any], *names: str, default: Any = None) -> Any:
    return next((raw[n] for n in names if raw.get(n) is not None), default)


def _layer_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    declared = raw.get("layer_types")
    linear = raw.get("linear_attn_config") or {}
    if declared is None and "full_attn_layers" in linear:
        full = {i - 1 for i in linear["full_attn_layers"]}  # 1-indexed in the checkpoint
        kda = {i - 1 for i in linear.get("kda_layers", ())} or set(range(layers)) - full
        # Only the first `layers` count (a bench keeps a published model's first layers).
        either = set(range(layers)) - (full ^ kda)
        if either:
            raise ValueError(
                f"linear_attn_config: layers {sorted(i + 1 for i in either)} (1-indexed) must be "
                "in exactly one of full_attn_layers and kda_layers"
            )
        return tuple(FULL if i in full else LINEAR for i in range(layers))
    if declared is None:
        return tuple(FULL if i and i % 4 == 0 else LINEAR for i in range(layers))
    if len(declared) < layers:
        raise ValueError(f"layer_types has {len(declared)} entries, num_hidden_layers={layers}")
    return tuple(declared[:layers])


def _mlp_types(raw: dict[str, Any], layers: int) -> tuple[str, ...]:
    declared = raw.get("mlp_layer_types")
    if declared is None:
        first = int(raw.get("first_k_dense_replace", 1))
        return tuple("dense" if i < first else "moe" for i in range(layers))
    kinds = {"dense": "dense", "sparse": "moe"}
    bad = sorted({k for k in declared if k not in kinds})
    if bad:
        raise ValueError(f"mlp_layer_types holds {bad}: each must be 'dense' or 'sparse'")
    return tuple(kinds[k] for k in declared[:layers])


def _refuse(raw: dict[str, Any]) -> None:
    refuse_unknown_fields(raw, HONOURED, "kimi_linear config")
    refuse_unknown_fields(
        raw.get("linear_attn_config") or {}, LINEAR_ATTN_FIELDS, "linear_attn_config"
    )
    if raw.get("hidden_act", "silu") != "silu":
        raise ValueError(f"hidden_act={raw['hidden_act']!r}: only 'silu' is supported")
    if parse_quantization_config(raw) is not None:
        raise ValueError("quantization_config is not supported for kimi_linear yet")
    if raw.get("mla_use_nope", True) is not True:
        raise ValueError("mla_use_nope=False is not supported: only true (MLA without rotary)")
    if raw.get("moe_router_activation_func", "sigmoid") != "sigmoid":
        raise ValueError(
            f"moe_router_activation_func={raw['moe_router_activation_func']!r}: only 'sigmoid'"
        )
    if raw.get("moe_layer_freq", 1) != 1:
        raise ValueError(f"moe_layer_freq={raw['moe_layer_freq']!r}: only 1 (every layer MoE)")


def parse_kimi_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    _refuse(raw)
    # Without grouped top-k the router picks over all experts: one group.
    grouped = raw.get("use_grouped_topk", True)
    layers, hidden = int(raw["num_hidden_layers"]), int(raw["hidden_size"])
    heads = int(raw["num_attention_heads"])
    nope, rope = int(raw["qk_nope_head_dim"]), int(raw["qk_rope_head_dim"])
    linear = raw.get("linear_attn_config") or {}
    kimi = KimiConfig(
        attention_types=_layer_types(raw, layers),
        num_heads=int(_pick(linear, "num_heads", default=raw.get("linear_num_heads", 32))),
        head_dim=int(_pick(linear, "head_dim", default=raw.get("linear_head_dim", 128))),
        conv_kernel=int(
            _pick(linear, "short_conv_kernel_size", default=raw.get("linear_conv_kernel_dim", 4))
        ),
    )
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    return ModelConfig(
        family=model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden,
        num_layers=layers,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-5)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(
            _pick(raw, "model_max_length", "max_position_embeddings", default=1 << 20)
        ),
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
        attention="mla",
        num_heads=heads,
        num_kv_heads=heads,
        head_dim=nope + rope,
        qk_norm=False,
        attention_bias=bool(raw.get("attention_bias", False)),
        # NoPE: the "rope" part of each key is shared across heads but never rotated; zero
        # frequencies make the rotation the identity.
        rope_inv_freq=(0.0,) * (rope // 2),
        rope_attention_scaling=1.0,
        rope_interleave=False,
        q_lora_rank=raw.get("q_lora_rank"),
        kv_lora_rank=int(raw["kv_lora_rank"]),
        qk_nope_head_dim=nope,
        qk_rope_head_dim=rope,
        v_head_dim=int(raw["v_head_dim"]),
        softmax_scale=(nope + rope) ** -0.5,
        layer_types=_mlp_types(raw, layers),
        intermediate_size=int(raw.get("intermediate_size") or 0),
        moe_intermediate_size=int(raw["moe_intermediate_size"]),
        num_experts=int(_pick(raw, "num_experts", "num_local_experts")),
        top_k=int(_pick(raw, "num_experts_per_token", "num_experts_per_tok")),
        n_shared_experts=int(_pick(raw, "num_shared_experts", "n_shared_experts", default=0)),
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=int(_pick(raw, "num_expert_group", "n_group", default=1)) if grouped else 1,
        topk_group=int(_pick(raw, "topk_group", default=1)) if grouped else 1,
        norm_topk_prob=bool(_pick(raw, "moe_renormalize", "norm_topk_prob", default=True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.0)),
        hidden_act="silu",
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        family_config=kimi,
    )
