"""DeepSeek-V3.2's and GLM-5's config.json -> afdserve's ModelConfig plus a `DSAConfig`.

Both are DeepSeek-V3's MLA and MoE (sigmoid scores, a selection bias, grouped top-k) with DeepSeek
Sparse Attention: a lightning indexer per layer picks the `index_topk` earlier tokens each query
attends to. GLM-5 differs in two ways transformers spells out: its indexer rotates interleaved
pairs (V3.2's rotates halves), and its "shared" layers run no indexer and reuse the previous full
layer's selection (`indexer_types`). Every key of config.json is honoured, ignored for a stated
reason, or refused by name, so a config that says something this code does not do fails loudly.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from afdserve.model.config import METADATA_FIELDS, ModelConfig
from afdserve.model.families.decoder.config import parse_decoder_config

MODEL_TYPES = ("deepseek_v32", "glm_moe_dsa")
ARCHITECTURES = {
    "DeepseekV32ForCausalLM": "deepseek_v32",
    "GlmMoeDsaForCausalLM": "glm_moe_dsa",
}
INDEXER_TYPES = ("full", "shared")
# transformers' defaults where config.json leaves a field out (DeepseekV32Config,
# GlmMoeDsaConfig); the MLA and MoE sizes have none worth guessing and are required.
DEFAULTS: dict[str, dict[str, Any]] = {
    "deepseek_v32": {
        "first_k_dense_replace": 3,
        "n_group": 8,
        "topk_group": 4,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 163840,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 64,
    },
    "glm_moe_dsa": {
        "first_k_dense_replace": 3,
        "n_group": 1,
        "topk_group": 1,
        "n_shared_experts": 1,
        "norm_topk_prob": True,
        "routed_scaling_factor": 2.5,
        "rms_norm_eps": 1e-5,
        "max_position_embeddings": 202752,
        "index_topk": 2048,
        "index_head_dim": 128,
        "index_n_heads": 32,
    },
}
REQUIRED = (
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "moe_intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "n_routed_experts",
    "num_experts_per_tok",
    "kv_lora_rank",
    "q_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
)
HONOURED = frozenset(
    {
        *REQUIRED,
        *DEFAULTS["deepseek_v32"],
        "num_key_value_heads",  # must equal num_attention_heads (MLA)
        "num_local_experts",  # transformers' alias of n_routed_experts
        "hidden_act",
        "bos_token_id",
        "eos_token_id",
        "tie_word_embeddings",
        "rope_parameters",
        "rope_scaling",
        "rope_theta",
        "rope_interleave",  # must be true: the main attention rotates interleaved pairs
        "indexer_rope_interleave",  # must say what the family's indexer does
        "mlp_layer_types",
        "layer_types",  # every layer "indexed_attention"
        "indexer_types",
        "index_topk_pattern",
        "index_topk_freq",
        "index_skip_topk_offset",
        "attention_bias",
        "mlp_bias",  # must be false
        "head_dim",  # transformers overwrites it with qk_rope_head_dim: derived, not read
        "qk_head_dim",  # must be qk_nope_head_dim + qk_rope_head_dim
        "moe_layer_freq",  # must be 1: every layer past the dense ones is MoE
        "topk_method",  # must be noaux_tc
        "scoring_func",  # must be sigmoid
        "quantization_config",  # block-scaled FP8 (model/quantization.py)
        "torch_dtype",
        "dtype",
        # The multi-token-prediction layers (model.layers.{num_hidden_layers}.*): transformers
        # builds none and neither does afdserve; the loader reports their tensors as unexpected
        # and skips them, as for DeepSeek-V3.
        "num_nextn_predict_layers",
    }
)
# Keys that change nothing at inference: metadata, training, and parallel layouts of other engines.
IGNORED = METADATA_FIELDS | {"aux_loss_alpha", "seq_aux", "ep_size"}


@dataclass(frozen=True)
class DSAConfig:
    """What DeepSeek Sparse Attention adds to MLA: the lightning indexer's shape, how many earlier
    tokens a query keeps, how the indexer rotates, and which layers run their own indexer."""

    index_topk: int
    index_n_heads: int
    index_head_dim: int
    # True: interleaved pairs (GLM-5); False: halves (DeepSeek-V3.2).
    indexer_interleave: bool
    # Per layer: "full" runs its indexer and caches its keys; "shared" reuses the selection of
    # the last full layer before it (GLM-5).
    indexer_types: tuple[str, ...]

    def has_indexer(self, layer: int) -> bool:
        return self.indexer_types[layer] == "full"


def _refuse(model_type: str, message: str) -> ValueError:
    return ValueError(f"{model_type} config: {message}")


def _check_keys(raw: dict[str, Any], model_type: str) -> None:
    unknown = sorted(k for k in raw if k not in HONOURED and k not in IGNORED)
    if unknown:
        raise _refuse(
            model_type,
            f"field {unknown[0]!r} is not supported"
            + (f" (nor {unknown[1:]})" if len(unknown) > 1 else ""),
        )
    missing = [k for k in REQUIRED if raw.get(k) is None and k != "n_routed_experts"]
    if raw.get("n_routed_experts") is None and raw.get("num_local_experts") is None:
        missing.append("n_routed_experts")
    if missing:
        raise _refuse(model_type, f"missing required field(s) {missing}")


def _check_values(raw: dict[str, Any], model_type: str) -> None:
    """The fields whose other values would need code afdserve does not have."""
    expect = {
        "hidden_act": "silu",
        "topk_method": "noaux_tc",
        "scoring_func": "sigmoid",
        "moe_layer_freq": 1,
        "mlp_bias": False,
        "rope_interleave": True,
        "indexer_rope_interleave": model_type == "glm_moe_dsa",
    }
    for key, want in expect.items():
        if key in raw and raw[key] != want:
            raise _refuse(model_type, f"{key}={raw[key]!r} is not supported: only {want!r}")
    heads = raw["num_attention_heads"]
    if raw.get("num_key_value_heads", heads) != heads:
        raise _refuse(
            model_type,
            f"num_key_value_heads={raw['num_key_value_heads']} must equal "
            f"num_attention_heads={heads} (MLA)",
        )
    qk = raw["qk_nope_head_dim"] + raw["qk_rope_head_dim"]
    if raw.get("qk_head_dim", qk) != qk:
        raise _refuse(model_type, f"qk_head_dim={raw['qk_head_dim']} must be {qk}")
    layers = raw.get("layer_types")
    if layers is not None and any(kind not in INDEXED_LAYER_TYPES for kind in layers):
        raise _refuse(
            model_type, f"layer_types={layers!r}: only {' or '.join(INDEXED_LAYER_TYPES)} layers"
        )


# transformers' spellings of a layer with the indexer: "indexed_attention" from 5.25, and
# "deepseek_sparse_attention" in the 5.17 that writes the configs of the GPU machine's tests.
INDEXED_LAYER_TYPES = ("indexed_attention", "deepseek_sparse_attention")


def _mlp_layer_types(raw: dict[str, Any], model_type: str, n: int) -> list[str] | None:
    """transformers' "dense" / "sparse" as afdserve's "dense" / "moe" (None: first_k_dense)."""
    kinds = raw.get("mlp_layer_types")
    if kinds is None:
        return None
    kinds = list(kinds)[:n]  # a preset's NAME:LAYERS keeps the published lists
    if len(kinds) < n or any(k not in ("dense", "sparse") for k in kinds):
        raise _refuse(
            model_type,
            f"mlp_layer_types={kinds!r}: {n} entries of 'dense' or 'sparse' expected",
        )
    return ["moe" if k == "sparse" else "dense" for k in kinds]


def _indexer_types(raw: dict[str, Any], model_type: str, n: int) -> tuple[str, ...]:
    """GLM-5's schedule as transformers derives it: `indexer_types`, else `index_topk_pattern`
    ("FSS..."), else every layer i with max(i - offset + 1, 0) % freq == 0 full."""
    kinds = raw.get("indexer_types")
    pattern = raw.get("index_topk_pattern")
    if kinds is None and pattern is not None:
        letters = {"F": "full", "S": "shared"}
        if isinstance(pattern, str) and set(pattern) <= set(letters):
            kinds = [letters[c] for c in pattern]
        else:
            kinds = list(pattern)
    if kinds is None:
        freq = max(int(raw.get("index_topk_freq", 1)), 1)
        offset = int(raw.get("index_skip_topk_offset", 2))
        kinds = ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(n)]
    kinds = list(kinds)[:n]
    if len(kinds) < n or any(k not in INDEXER_TYPES for k in kinds):
        raise _refuse(model_type, f"indexer_types={kinds!r}: {n} entries of {INDEXER_TYPES}")
    if kinds[0] != "full":
        raise _refuse(
            model_type,
            "indexer_types[0] must be 'full': a shared layer reuses the "
            "selection of a full layer before it",
        )
    if model_type == "deepseek_v32" and "shared" in kinds:
        raise _refuse(model_type, "shared indexer layers are GLM-5's; DeepSeek-V3.2 has none")
    return tuple(kinds)


def parse_dsa_config(raw: dict[str, Any], model_type: str) -> ModelConfig:
    _check_keys(raw, model_type)
    raw = {**DEFAULTS[model_type], **{k: v for k, v in raw.items() if v is not None}}
    _check_values(raw, model_type)
    n = int(raw["num_hidden_layers"])
    index_dim, rope_dim = int(raw["index_head_dim"]), int(raw["qk_rope_head_dim"])
    if not 0 < rope_dim <= index_dim:
        raise _refuse(
            model_type,
            f"qk_rope_head_dim={rope_dim} must be in (0, index_head_dim={index_dim}]: the "
            "indexer rotates that many of its dims",
        )
    dsa = DSAConfig(
        index_topk=int(raw["index_topk"]),
        index_n_heads=int(raw["index_n_heads"]),
        index_head_dim=index_dim,
        indexer_interleave=model_type == "glm_moe_dsa",
        indexer_types=_indexer_types(raw, model_type, n),
    )
    if dsa.index_topk < 1:
        raise _refuse(model_type, f"index_topk={dsa.index_topk} must be >= 1")
    # The rest is DeepSeek-V3's, as the decoder family reads it.
    v3 = {**raw, "model_type": "deepseek_v3", "topk_method": "noaux_tc", "scoring_func": "sigmoid"}
    v3["n_routed_experts"] = raw.get("n_routed_experts") or raw.get("num_local_experts")
    kinds = _mlp_layer_types(raw, model_type, n)
    if kinds is not None:
        v3["mlp_layer_types"] = kinds
        v3["first_k_dense_replace"] = kinds.index("moe") if "moe" in kinds else n
    config = parse_decoder_config(v3, "deepseek_v3")
    return replace(config, family=model_type, family_config=dsa)
