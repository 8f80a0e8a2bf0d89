"""DeepSeek-V4's config.json -> afdserve's ModelConfig (FFN side) plus a V4Config (attention, mHC).

Every key of config.json is either honoured, ignored for a stated reason (training-only, metadata),
or refused by name: a checkpoint whose config says something this code does not do must not load
as if it said something else. Legacy spellings that transformers folds in (`compress_ratios`,
`compress_rate_csa`/`_hca`, `num_hash_layers`, `qk_rope_head_dim`) are folded the same way.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from afdserve.model.quantization import parse_quantization_config


@dataclass(frozen=True)
class V4Config:
    """The attention side of DeepSeek-V4: per-layer attention type, compression, indexer, mHC."""

    attention_types: tuple[str, ...]
    csa_rate: int
    hca_rate: int
    sliding_window: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    o_groups: int
    o_lora_rank: int
    index_n_heads: int
    index_head_dim: int
    index_topk: int
    # Rotary of the compressed layers, their compressors and indexer ("compress" in transformers);
    # the sliding layers use ModelConfig.rope_inv_freq ("main").
    compress_inv_freq: tuple[float, ...]
    compress_attention_scaling: float
    main_attention_scaling: float

    def compress_rate(self, layer: int) -> int:
        kind = self.attention_types[layer]
        return {
            "compressed_sparse_attention": self.csa_rate,
            "heavily_compressed_attention": self.hca_rate,
        }.get(kind, 0)


ATTENTION_TYPES = (
    "sliding_attention",
    "compressed_sparse_attention",
    "heavily_compressed_attention",
)
COMPRESSED_TYPES = ATTENTION_TYPES[1:]
MLP_TYPES = ("hash_moe", "moe")
# What transformers picks when the config leaves them out.
DEFAULT_COMPRESS_RATES = {"compressed_sparse_attention": 4, "heavily_compressed_attention": 128}
DEFAULT_NUM_HASH_LAYERS = 3
_RATIO_TO_TYPE = {
    0: "sliding_attention",
    4: "compressed_sparse_attention",
    128: "heavily_compressed_attention",
}

HONOURED = frozenset(
    {
        "vocab_size",
        "hidden_size",
        "moe_intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "q_lora_rank",
        "num_experts_per_tok",
        "n_routed_experts",
        "n_shared_experts",
        "scoring_func",
        "norm_topk_prob",
        "routed_scaling_factor",
        "max_position_embeddings",
        "rope_theta",
        "layer_types",
        "compress_rates",
        "compress_rope_theta",
        "hc_mult",
        "hc_sinkhorn_iters",
        "hc_eps",
        "mlp_layer_types",
        "swiglu_limit",
        "sliding_window",
        "o_groups",
        "o_lora_rank",
        "index_n_heads",
        "index_head_dim",
        "index_topk",
        "hidden_act",
        "rms_norm_eps",
        "bos_token_id",
        "eos_token_id",
        "pad_token_id",
        "tie_word_embeddings",
        "rope_parameters",
        "partial_rotary_factor",
        "attention_bias",
        "mlp_bias",
        "qk_rope_head_dim",
        "compress_ratios",
        "compress_rate_csa",
        "compress_rate_hca",
        "num_hash_layers",
        "dtype",
        "torch_dtype",
        # FP8 weights with ue8m0 scales, FP4 routed experts (model/families/deepseek_v4/quant.py);
        # V4 says expert_dtype at the top level, which transformers moves into quantization_config.
        "quantization_config",
        "expert_dtype",
        # DeepSeek-V4-Flash's config.json says both: the routing V4 always has (checked below), and
        # YaRN in the spelling transformers folds into rope_parameters (of "compress" only).
        "topk_method",
        "rope_scaling",
        # The multi-token-prediction layers: the main model skips their `mtp.*` tensors by name;
        # speculative decoding's `mtp` method builds the draft from them (mtp.py).
        "num_nextn_predict_layers",
    }
)
# Keys that change nothing at inference.
IGNORED = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "router_jitter_noise",
        "output_attentions",
        "output_hidden_states",
        "return_dict",
        "chunk_size_feed_forward",
        "is_encoder_decoder",
        "id2label",
        "label2id",
        "problem_type",
    }
)


def _check_keys(raw: dict[str, Any]) -> None:
    unknown = sorted(k for k in raw if k not in HONOURED and k not in IGNORED)
    if unknown:
        raise ValueError(
            f"deepseek_v4 config field {unknown[0]!r} is not supported"
            + (f" (nor {unknown[1:]})" if len(unknown) > 1 else "")
        )


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(f"deepseek_v4 config: {message}")


def _attention_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    types = raw.get("layer_types")
    if types is None and raw.get("compress_ratios") is not None:
        ratios = list(raw["compress_ratios"])
        for i, r in enumerate(ratios):
            _require(
                r in _RATIO_TO_TYPE, f"compress_ratios[{i}]={r!r}: one of {list(_RATIO_TO_TYPE)}"
            )
        types = [_RATIO_TO_TYPE[r] for r in ratios]
    if types is None:  # transformers' default: two HCA layers, then CSA and HCA alternating
        types = ["heavily_compressed_attention"] * min(n, 2) + [
            "compressed_sparse_attention" if i % 2 else "heavily_compressed_attention"
            for i in range(max(n - 2, 0))
        ]
    _require(len(types) >= n, f"layer_types has {len(types)} entries, num_hidden_layers={n}")
    types = tuple(types[:n])
    for i, kind in enumerate(types):
        _require(kind in ATTENTION_TYPES, f"layer_types[{i}]={kind!r}: one of {ATTENTION_TYPES}")
    return types


def _mlp_types(raw: dict[str, Any], n: int) -> tuple[str, ...]:
    types = raw.get("mlp_layer_types")
    if types is None:
        hashed = raw.get("num_hash_layers")
        hashed = DEFAULT_NUM_HASH_LAYERS if hashed is None else int(hashed)
        types = ["hash_moe"] * min(n, hashed) + ["moe"] * max(0, n - hashed)
    _require(len(types) >= n, f"mlp_layer_types has {len(types)} entries, num_hidden_layers={n}")
    types = tuple(types[:n])
    for i, kind in enumerate(types):
        _require(kind in MLP_TYPES, f"mlp_layer_types[{i}]={kind!r}: one of {MLP_TYPES}")
    return types


def _compress_rates(raw: dict[str, Any]) -> tuple[int, int]:
    rates = dict(raw.get("compress_rates") or DEFAULT_COMPRESS_RATES)
    for key, legacy in (
        ("compressed_sparse_attention", "compress_rate_csa"),
        ("heavily_compressed_attention", "compress_rate_hca"),
    ):
        if raw.get(legacy) is not None:
            rates[key] = raw[legacy]
    for key in rates:
        _require(key in COMPRESSED_TYPES, f"compress_rates[{key!r}]: keys are {COMPRESSED_TYPES}")
    for key in COMPRESSED_TYPES:
        rate = rates.get(key, DEFAULT_COMPRESS_RATES[key])
        _require(
            isinstance(rate, int) and rate >= 2,
            f"compress_rates[{key!r}]={rate!r}: must be an int >= 2",
        )
        rates[key] = rate
    return rates["compressed_sparse_attention"], rates["heavily_compressed_attention"]


def _rope(
    raw: dict[str, Any],
    label: str,
    theta: float,
    factor: float,
    head_dim: int,
) -> tuple[tuple[float, ...], float]:
    """Inverse frequencies and cos/sin scale of one rope label ("main" or "compress"). Scaled
    types (YaRN on "compress") come from transformers' own definitions, through its config class,
    so that positions mean what the checkpoint's authors meant."""
    params = raw.get("rope_parameters") or {}
    if isinstance(params.get("main"), dict) and isinstance(params.get("compress"), dict):
        params = dict(params[label])
    elif label == "main":  # transformers: a flat rope_parameters (YaRN) scales "compress" only
        params = {"rope_theta": theta}
    else:
        params = {k: v for k, v in params.items() if k not in ("main", "compress")}
        params["rope_theta"] = theta  # transformers takes compress_rope_theta over the flat one
    kind = params.get("rope_type", params.get("type", "default"))
    theta = float(params.get("rope_theta", theta))
    dim = int(head_dim * float(params.get("partial_rotary_factor", factor)))
    if kind == "default":
        import torch  # float32 like transformers' formula, so both round the same way

        inv = 1.0 / (theta ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
        return tuple(inv.tolist()), 1.0
    from transformers import DeepseekV4Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    _require(
        kind in ROPE_INIT_FUNCTIONS,
        f"rope_parameters[{label!r}].rope_type={kind!r}: one of {sorted(ROPE_INIT_FUNCTIONS)}",
    )
    hf = DeepseekV4Config(**{k: v for k, v in raw.items() if k not in IGNORED})
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[kind](hf, "cpu", layer_type=label)
    return tuple(inv_freq.tolist()), float(scaling)


def v4_model_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Every ModelConfig field of a DeepSeek-V4 config.json (model/config.py builds the
    ModelConfig, so this module needs nothing from there). The checks run in a fixed order, so a
    config with several faults is refused for the same one each time."""
    _check_keys(raw)
    raw = _fold_rope_scaling(raw)
    _require(
        raw.get("topk_method", "noaux_tc") == "noaux_tc",
        f"topk_method={raw.get('topk_method')!r}: V4 routes 'noaux_tc' only",
    )
    n = int(raw.get("num_hidden_layers", 43))
    hidden, heads = int(raw.get("hidden_size", 4096)), int(raw.get("num_attention_heads", 64))
    head_dim = int(raw.get("head_dim", 512))
    _check_fixed_choices(raw)
    factor, rope_dim = _rotary_width(raw, head_dim)
    index_head_dim, o_groups = _index_and_output_groups(raw, heads, rope_dim)
    num_experts, top_k = _routed_experts(raw)
    _check_positive_ints(raw)
    csa, hca = _compress_rates(raw)
    (main_inv, main_scale), (comp_inv, comp_scale) = _ropes(raw, factor, head_dim, rope_dim)
    v4 = V4Config(
        attention_types=_attention_types(raw, n),
        csa_rate=csa,
        hca_rate=hca,
        sliding_window=int(raw.get("sliding_window", 128)),
        hc_mult=int(raw.get("hc_mult", 4)),
        hc_sinkhorn_iters=int(raw.get("hc_sinkhorn_iters", 20)),
        hc_eps=float(raw.get("hc_eps", 1e-6)),
        o_groups=o_groups,
        o_lora_rank=int(raw.get("o_lora_rank", 1024)),
        index_n_heads=int(raw.get("index_n_heads", 64)),
        index_head_dim=index_head_dim,
        index_topk=int(raw.get("index_topk", 512)),
        compress_inv_freq=comp_inv,
        compress_attention_scaling=comp_scale,
        main_attention_scaling=main_scale,
    )
    quantization, inter = _expert_precision(raw, hidden)
    return dict(
        family="deepseek_v4",
        **_model_fields(raw, n, hidden),
        **_attention_fields(raw, heads, head_dim, rope_dim, main_inv, main_scale),
        **_ffn_fields(raw, n, inter, num_experts, top_k),
        family_config=v4,
        quantization=quantization,
    )


def _fold_rope_scaling(raw: dict[str, Any]) -> dict[str, Any]:
    """`rope_scaling` is another spelling of `rope_parameters` (V4-Flash's config.json uses it)."""
    if raw.get("rope_scaling") is None:
        return raw
    _require(
        raw.get("rope_parameters") is None,
        "rope_scaling and rope_parameters both given: give one",
    )
    return {
        **{k: v for k, v in raw.items() if k != "rope_scaling"},
        "rope_parameters": raw["rope_scaling"],
    }


def _check_fixed_choices(raw: dict[str, Any]) -> None:
    """What V4 defines one way only: shared-KV MQA, one shared expert, normalised top-k scores,
    no projection biases, SiLU."""
    _require(
        int(raw.get("num_key_value_heads", 1)) == 1,
        f"num_key_value_heads={raw.get('num_key_value_heads')!r}: V4 attention is "
        "shared-KV MQA, exactly 1",
    )
    _require(
        int(raw.get("n_shared_experts", 1)) == 1,
        f"n_shared_experts={raw.get('n_shared_experts')!r}: V4 defines exactly 1",
    )
    _require(
        raw.get("norm_topk_prob", True) is True,
        "norm_topk_prob=False: V4 always normalises the chosen experts' scores",
    )
    for key in ("attention_bias", "mlp_bias"):
        _require(not raw.get(key, False), f"{key}=True: V4 projections have no bias")
    _require(
        raw.get("hidden_act", "silu") == "silu",
        f"hidden_act={raw.get('hidden_act')!r}: only 'silu'",
    )


def _rotary_width(raw: dict[str, Any], head_dim: int) -> tuple[float, int]:
    """(partial_rotary_factor, rotary width), from the factor or the legacy qk_rope_head_dim."""
    factor = raw.get("partial_rotary_factor")
    if factor is None:
        legacy = raw.get("qk_rope_head_dim")
        factor = legacy / head_dim if legacy is not None else 64 / 512
    rope_dim = int(head_dim * float(factor))
    if raw.get("qk_rope_head_dim") is not None:
        _require(
            int(raw["qk_rope_head_dim"]) == rope_dim,
            f"qk_rope_head_dim={raw['qk_rope_head_dim']} but head_dim * "
            f"partial_rotary_factor = {rope_dim}",
        )
    _require(
        0 < rope_dim <= head_dim and rope_dim % 2 == 0,
        f"partial_rotary_factor={factor}: rotary width {rope_dim} must be even, in "
        f"(0, head_dim={head_dim}]",
    )
    return factor, rope_dim


def _index_and_output_groups(raw: dict[str, Any], heads: int, rope_dim: int) -> tuple[int, int]:
    """(index_head_dim, o_groups): the indexer's heads carry the rotary part; the output
    projection's groups split the attention heads evenly."""
    index_head_dim = int(raw.get("index_head_dim", 128))
    _require(
        rope_dim <= index_head_dim,
        f"index_head_dim={index_head_dim}: below the rotary width {rope_dim}",
    )
    o_groups = int(raw.get("o_groups", 8))
    _require(
        o_groups >= 1 and heads % o_groups == 0,
        f"o_groups={o_groups}: must divide num_attention_heads={heads}",
    )
    return index_head_dim, o_groups


def _routed_experts(raw: dict[str, Any]) -> tuple[int, int]:
    num_experts = int(raw.get("n_routed_experts", 256))
    top_k = int(raw.get("num_experts_per_tok", 6))
    _require(
        1 <= top_k <= num_experts,
        f"num_experts_per_tok={top_k}: must be in [1, n_routed_experts={num_experts}]",
    )
    return num_experts, top_k


def _check_positive_ints(raw: dict[str, Any]) -> None:
    for key, low in (
        ("sliding_window", 1),
        ("hc_mult", 1),
        ("hc_sinkhorn_iters", 1),
        ("index_topk", 1),
        ("index_n_heads", 1),
        ("o_lora_rank", 1),
        ("q_lora_rank", 1),
    ):
        if key in raw:
            _require(
                isinstance(raw[key], int) and raw[key] >= low,
                f"{key}={raw[key]!r}: must be an int >= {low}",
            )


def _ropes(
    raw: dict[str, Any], factor: float, head_dim: int, rope_dim: int
) -> tuple[tuple[tuple[float, ...], float], tuple[tuple[float, ...], float]]:
    """(inverse frequencies, scale) of "main" and of "compress", each as wide as the rotary."""
    main = _rope(raw, "main", float(raw.get("rope_theta", 10000.0)), factor, head_dim)
    compress = _rope(
        raw, "compress", float(raw.get("compress_rope_theta", 160000.0)), factor, head_dim
    )
    for label, (inv, _) in (("main", main), ("compress", compress)):
        _require(
            len(inv) * 2 == rope_dim,
            f"rope_parameters[{label!r}] gives {len(inv)} "
            f"frequencies for the rotary width {rope_dim}",
        )
    return main, compress


def _expert_precision(raw: dict[str, Any], hidden: int) -> tuple[Any, int]:
    """(quantization, moe_intermediate_size): FP4 experts need both widths in whole 32-blocks."""
    quantization = parse_quantization_config(raw, fp4_experts=True)
    _require(
        raw.get("expert_dtype") is None or quantization is not None,
        f"expert_dtype={raw.get('expert_dtype')!r} without a quantization_config: the "
        "experts' precision needs the checkpoint's FP8 quantization_config beside it",
    )
    inter = int(raw.get("moe_intermediate_size", 2048))
    if quantization is not None and quantization.expert_dtype == "fp4":
        _require(
            hidden % 32 == 0 and inter % 32 == 0,
            f"expert_dtype='fp4' with hidden_size={hidden}, moe_intermediate_size={inter}: "
            "both must be multiples of 32 (one ue8m0 scale per 32 inputs)",
        )
    return quantization, inter


def _model_fields(raw: dict[str, Any], n: int, hidden: int) -> dict[str, Any]:
    """The fields neither half owns: sizes, norms, embeddings, special tokens, dtype."""
    eos = raw.get("eos_token_id", 1)
    return dict(
        vocab_size=int(raw.get("vocab_size", 129280)),
        hidden_size=hidden,
        num_layers=n,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        max_position_embeddings=int(raw.get("max_position_embeddings", 1048576)),
        bos_token_id=raw.get("bos_token_id", 0),
        eos_token_ids=tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),)),
        torch_dtype=raw.get("torch_dtype") or raw.get("dtype"),
    )


def _attention_fields(
    raw: dict[str, Any],
    heads: int,
    head_dim: int,
    rope_dim: int,
    main_inv: tuple[float, ...],
    main_scale: float,
) -> dict[str, Any]:
    """ModelConfig's attention fields; the rest of V4's attention is in V4Config."""
    return dict(
        attention="v4",
        num_heads=heads,
        num_kv_heads=1,
        head_dim=head_dim,
        qk_norm=False,
        attention_bias=False,
        rope_inv_freq=main_inv,
        rope_attention_scaling=main_scale,
        rope_interleave=True,
        q_lora_rank=int(raw.get("q_lora_rank", 1024)),
        kv_lora_rank=0,
        qk_nope_head_dim=head_dim - rope_dim,
        qk_rope_head_dim=rope_dim,
        v_head_dim=head_dim,
        softmax_scale=head_dim**-0.5,
    )


def _ffn_fields(
    raw: dict[str, Any], n: int, inter: int, num_experts: int, top_k: int
) -> dict[str, Any]:
    limit = raw.get("swiglu_limit", 10.0)
    return dict(
        layer_types=_mlp_types(raw, n),
        intermediate_size=0,
        moe_intermediate_size=inter,
        num_experts=num_experts,
        top_k=top_k,
        n_shared_experts=1,
        scoring=raw.get("scoring_func", "sqrtsoftplus"),
        # Top-k on scores + e_score_correction_bias, weights from the scores: DeepSeek-V3's
        # noaux_tc with a single expert group.
        topk_method="noaux_tc",
        n_group=1,
        topk_group=1,
        norm_topk_prob=True,
        routed_scaling_factor=float(raw.get("routed_scaling_factor", 1.5)),
        hidden_act="silu",
        swiglu_limit=None if limit is None else float(limit),
    )
