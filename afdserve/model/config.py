"""ModelConfig: one uniform description of every supported family, read from an HF config.json
(each family's parser: model/families/)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from afdserve.model.quantization import Fp8Spec

LAYER_TYPES = ("dense", "moe", "hash_moe")
SCORING_FUNCS = ("softmax", "sigmoid", "sqrtsoftplus")


# What every config.json may carry that changes nothing at inference: metadata, the generic
# fields transformers writes for every model, and training-only settings.
METADATA_FIELDS = frozenset(
    {
        "architectures",
        "model_type",
        "transformers_version",
        "_name_or_path",
        "auto_map",
        "dtype",
        "torch_dtype",
        "initializer_range",
        "use_cache",
        "attention_dropout",
        "output_router_logits",
        "router_aux_loss_coef",
        "pretraining_tp",
        "pad_token_id",  # the tokenizer's; the engine pads with its own id
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


def refuse_unknown_fields(raw: dict[str, Any], known: frozenset[str], where: str) -> None:
    """A ValueError naming the fields of `raw` that are neither `known` to the family's parser
    nor metadata: a field nobody reads could change the model (a checkpoint's new option), so it
    is refused by name rather than ignored."""
    unknown = sorted(k for k in raw if k not in known and k not in METADATA_FIELDS)
    if unknown:
        raise ValueError(
            f"{where}: field(s) {unknown} not supported (afdserve reads {sorted(known)})"
        )


def common_fields(raw: dict[str, Any], rms_norm_eps: float, max_positions: int) -> dict[str, Any]:
    """The ModelConfig fields every family reads alike from config.json; the defaults where a key
    is absent are the family's transformers config's."""
    eos = raw.get("eos_token_id")
    return {
        "vocab_size": int(raw["vocab_size"]),
        "hidden_size": int(raw["hidden_size"]),
        "num_layers": int(raw["num_hidden_layers"]),
        "rms_norm_eps": float(raw.get("rms_norm_eps", rms_norm_eps)),
        "tie_word_embeddings": bool(raw.get("tie_word_embeddings", False)),
        "max_position_embeddings": int(raw.get("max_position_embeddings", max_positions)),
        "bos_token_id": raw.get("bos_token_id"),
        "eos_token_ids": tuple(eos)
        if isinstance(eos, list)
        else (() if eos is None else (int(eos),)),
    }


@dataclass(frozen=True)
class ModelConfig:
    family: str
    vocab_size: int
    hidden_size: int
    num_layers: int
    rms_norm_eps: float
    tie_word_embeddings: bool
    max_position_embeddings: int
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    # attention
    attention: str  # "gqa" or "mla"
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qk_norm: bool
    attention_bias: bool
    rope_inv_freq: tuple[float, ...]
    rope_attention_scaling: float
    rope_interleave: bool
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    softmax_scale: float
    # FFN
    layer_types: tuple[str, ...]  # per layer: dense | moe | hash_moe
    intermediate_size: int
    moe_intermediate_size: int
    num_experts: int
    top_k: int
    n_shared_experts: int
    scoring: str  # softmax | sigmoid | sqrtsoftplus
    topk_method: str  # greedy | group_limited_greedy | noaux_tc
    n_group: int
    topk_group: int
    norm_topk_prob: bool
    routed_scaling_factor: float
    hidden_act: str
    torch_dtype: str | None
    # Block-scaled FP8 weights (model/layers/fp8.py): from quantization_config, or the engine's
    # quantization="fp8" (online). None: every weight in the model dtype.
    quantization: Fp8Spec | None = None
    # SwiGLU clamp of experts and shared experts (DeepSeek-V4); None: no clamp.
    swiglu_limit: float | None = None
    # What only the family's own modules read (DeepSeek-V4: its attention side and mHC,
    # model/families/deepseek_v4/config.py's V4Config); None where the fields above say it all.
    family_config: Any = None

    def __post_init__(self) -> None:
        for i, kind in enumerate(self.layer_types):
            if kind not in LAYER_TYPES:
                raise ValueError(f"mlp_layer_types[{i}]={kind!r}: one of {LAYER_TYPES}")
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"mlp_layer_types has {len(self.layer_types)} entries, the model has "
                f"{self.num_layers} layers"
            )
        if self.scoring not in SCORING_FUNCS:
            raise ValueError(f"scoring_func={self.scoring!r}: one of {SCORING_FUNCS}")
        if self.hidden_act != "silu":
            raise ValueError(f"hidden_act={self.hidden_act!r}: only 'silu' is supported")
        if self.topk_method in ("group_limited_greedy", "noaux_tc") and (
            self.n_group < 1 or self.num_experts % self.n_group
        ):
            raise ValueError(f"n_group={self.n_group}: must divide num_experts={self.num_experts}")

    @property
    def kv_cache_dim(self) -> int:
        """Width of one cached token per KV head (MLA caches the compressed latent)."""
        if self.attention not in ("gqa", "mla"):
            raise ValueError(
                f"family {self.family!r} has no single per-token KV width: its layers describe "
                "their own pages (model/cache.py)"
            )
        if self.attention == "mla":
            return self.kv_lora_rank + self.qk_rope_head_dim
        return self.head_dim

    @property
    def num_cache_heads(self) -> int:
        return 1 if self.attention == "mla" else self.num_kv_heads

    @property
    def hash_layers(self) -> tuple[int, ...]:
        return tuple(i for i, k in enumerate(self.layer_types) if k == "hash_moe")


def read_hf_config(model_dir: str | Path) -> dict[str, Any]:
    path = Path(model_dir) / "config.json"
    if not path.is_file():
        raise FileNotFoundError(
            f"{model_dir}: no config.json (expected a Hugging Face model directory)"
        )
    with open(path) as f:
        return json.load(f)
