"""config.json -> ModelConfig for MiniMax-M2 (transformers' `minimax_m2`, the oracle): GQA whose
q_norm / k_norm normalise each row's whole projected q and k (not each head), partial rotary on
each head's first `rotary_dim` channels, and every layer a MoE of sigmoid-scored experts chosen
with `e_score_correction_bias` added (DeepSeek-V3's noaux_tc with one group).

Every key of config.json is honoured, ignored because it only matters in training (or names
nothing afdserve builds), or refused by name. Keys carried over from MiniMax-Text-01 (lightning
attention layers, residual alpha/beta scaling, shared experts, sliding windows) are accepted at
the one value MiniMax-M2 publishes, which means "off"; any other value is refused."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from afdserve.model.config import ModelConfig, common_fields
from afdserve.model.families.decoder.config import _rope, _rope_frequencies
from afdserve.model.quantization import parse_quantization_config

FAMILY = "minimax_m2"


@dataclass(frozen=True)
class MiniMaxM2Options:
    """What MiniMax-M2's modules read beyond ModelConfig (ModelConfig.family_config)."""

    # q_norm / k_norm weights span heads * head_dim (kv_heads * head_dim) and normalise the
    # whole projected row: transformers' MiniMaxM2Attention (vLLM: qk_norm_type "per_layer").
    qk_norm_over_heads: bool = True
    # The multi-token-prediction modules of the checkpoint (`model.layers.{N + i}.*`): not built,
    # their tensors reported as unexpected and skipped at load, as other families' MTP layers.
    mtp_modules: int = 0


HONOURED = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "intermediate_size",  # each routed expert's width (there is no dense layer)
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "hidden_act",
        "max_position_embeddings",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "num_experts_per_tok",
        "num_local_experts",
        "num_experts",  # transformers' alias of num_local_experts
        "rope_theta",
        "rope_parameters",
        "rope_scaling",
        "rotary_dim",
        "partial_rotary_factor",
        # transformers always renormalises the top-k weights and scales them by nothing; a config
        # that says otherwise is honoured (the published ones say neither).
        "norm_topk_prob",
        "routed_scaling_factor",
        "quantization_config",
        "torch_dtype",
        "dtype",
    }
)
# key -> the one value honoured (MiniMax-M2's); any other is refused by name.
FIXED: dict[str, tuple[Any, ...]] = {
    "scoring_func": ("sigmoid",),
    "use_routing_bias": (True,),
    "use_qk_norm": (True,),
    "qk_norm_type": ("per_layer",),
    "attention_bias": (False,),
    "sliding_window": (None,),
    "shared_intermediate_size": (0, None),
    "layernorm_full_attention_alpha": (1, 1.0),
    "layernorm_full_attention_beta": (1, 1.0),
    "layernorm_linear_attention_alpha": (1, 1.0),
    "layernorm_linear_attention_beta": (1, 1.0),
    "layernorm_mlp_alpha": (1, 1.0),
    "layernorm_mlp_beta": (1, 1.0),
    # transformers' spelling of the same factors (its `minimax`, MiniMax-Text-01).
    "full_attn_alpha_factor": (1, 1.0),
    "full_attn_beta_factor": (1, 1.0),
    "linear_attn_alpha_factor": (1, 1.0),
    "linear_attn_beta_factor": (1, 1.0),
    "mlp_alpha_factor": (1, 1.0),
    "mlp_beta_factor": (1, 1.0),
    "postnorm": (False,),
}
# The MTP modules: not built (see MiniMaxM2Options.mtp_modules).
MTP_KEYS = ("num_mtp_modules", "mtp_transformer_layers", "use_mtp")
IGNORED = frozenset(
    {
        "architectures",
        "model_type",
        "auto_map",
        "transformers_version",
        "_name_or_path",
        "pad_token_id",
        "use_cache",
        "max_model_len",  # a serving hint (null when published); --max-model-len decides
        # Training only: init, dropout, the router's auxiliary loss and jitter, router logits.
        "initializer_range",
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        # MiniMax-Text-01's dense MLP width and shared-expert gate: M2 has neither (every layer
        # routes, shared_intermediate_size is 0), and neither transformers nor vLLM reads them.
        "mlp_intermediate_size",
        "shared_moe_mode",
        "block_size",  # Text-01's lightning-attention block: M2 has no such layer
    }
)


def _refuse(message: str) -> None:
    raise ValueError(f"minimax_m2 config: {message}")


def _check_keys(raw: dict[str, Any], layers: int) -> None:
    known = HONOURED | IGNORED | set(FIXED) | set(MTP_KEYS) | {"attn_type_list", "layer_types"}
    unknown = sorted(k for k in raw if k not in known)
    if unknown:
        others = f" (nor {unknown[1:]})" if len(unknown) > 1 else ""
        _refuse(f"field {unknown[0]!r} is not supported{others}")
    for key, allowed in FIXED.items():
        if key in raw and raw[key] not in allowed:
            _refuse(f"{key}={raw[key]!r} is not supported: only {allowed[0]!r} (MiniMax-M2's)")
    # MiniMax-Text-01's lightning (linear) attention layers, in either spelling (0 in
    # attn_type_list, "linear_attention" in layer_types): transformers' M2 has none.
    kinds = raw.get("attn_type_list")
    if kinds is not None and any(kind != 1 for kind in list(kinds)[:layers]):
        _refuse(f"attn_type_list={kinds!r}: only full attention (1) in every layer")
    kinds = raw.get("layer_types")
    if kinds is not None and any(kind != "full_attention" for kind in list(kinds)[:layers]):
        _refuse(f"layer_types={kinds!r}: only 'full_attention' in every layer")


def _rotary_dim(raw: dict[str, Any], head_dim: int) -> int:
    """The rotated width per head: rotary_dim (what MiniMax publishes), else
    partial_rotary_factor (top level or in rope_parameters) times head_dim, else head_dim."""
    factor = raw.get("partial_rotary_factor")
    rope_parameters = raw.get("rope_parameters")
    if factor is None and isinstance(rope_parameters, dict):
        factor = rope_parameters.get("partial_rotary_factor")
    dim = raw.get("rotary_dim")
    dim = int(dim) if dim is not None else int(head_dim * float(factor or 1.0))
    if factor is not None and dim != int(head_dim * float(factor)):
        _refuse(
            f"rotary_dim={dim} and partial_rotary_factor={factor} disagree (head_dim={head_dim})"
        )
    if not (0 < dim <= head_dim and dim % 2 == 0):
        _refuse(f"rotary_dim={dim}: an even width in (0, head_dim={head_dim}]")
    return dim


def parse_minimax_m2_config(raw: dict[str, Any], model_type: str = FAMILY) -> ModelConfig:
    layers = int(raw["num_hidden_layers"])
    _check_keys(raw, layers)
    hidden, heads = int(raw["hidden_size"]), int(raw["num_attention_heads"])
    head_dim = int(raw.get("head_dim") or hidden // heads)
    theta, params = _rope(raw)
    rotary_dim = _rotary_dim(raw, head_dim)
    inv_freq, rope_scaling = _rope_frequencies(raw, theta, params, rotary_dim)
    experts = raw.get("num_local_experts", raw.get("num_experts"))
    mtp = int(raw.get("num_mtp_modules") or 0) if raw.get("use_mtp", True) else 0
    return ModelConfig(
        family=FAMILY,
        **common_fields(raw, 1e-6, 4096),
        attention="gqa",
        num_heads=heads,
        num_kv_heads=int(raw.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        qk_norm=True,
        attention_bias=False,
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
        intermediate_size=0,
        moe_intermediate_size=int(raw["intermediate_size"]),
        num_experts=int(experts),
        top_k=int(raw["num_experts_per_tok"]),
        n_shared_experts=0,
        scoring="sigmoid",
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        norm_topk_prob=bool(raw.get("norm_topk_prob", True)),
        routed_scaling_factor=float(raw.get("routed_scaling_factor") or 1.0),
        hidden_act=raw.get("hidden_act", "silu"),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
        quantization=parse_quantization_config(raw),
        family_config=MiniMaxM2Options(mtp_modules=mtp),
    )
