"""The DeepSeek-V4 part of ModelConfig: what only the V4 attention side and mHC read."""

from __future__ import annotations

from dataclasses import dataclass


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
