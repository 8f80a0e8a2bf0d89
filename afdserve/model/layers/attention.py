"""Attention of the two kinds afdserve serves: GQA (Qwen3-MoE, Mixtral, MiniMax-M2) and MLA
(DeepSeek-V2/V3).

Each layer owns its slice of the paged KV cache, handed in per call: `(k_cache, v_cache)` for GQA,
`(latent_cache, None)` for MLA, which caches the compressed latent plus the rotated key part.
A cache of float8_e4m3fn (kv_cache_dtype="fp8") is written and read through the layer's per-tensor
`k_scale` / `v_scale`: Python floats, 1.0 (vLLM's default for a checkpoint without KV scales;
engine/factory.py refuses a checkpoint that carries them), constants inside a captured graph.
"""

from __future__ import annotations

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata, QKVLayout
from afdserve.kernels.ops import Fp8Rows
from afdserve.model.config import ModelConfig
from afdserve.model.layers.common import RMSNorm, Rotary
from afdserve.model.layers.fp8 import Fp8Linear, linear_weight
from afdserve.model.layers.packed import PackedLinear

LayerCache = tuple[torch.Tensor, torch.Tensor | None]


class GQAAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = (
            config.num_heads,
            config.num_kv_heads,
            config.head_dim,
        )
        hidden, bias = config.hidden_size, config.attention_bias
        self.q_proj = nn.Linear(hidden, self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(hidden, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, hidden, bias=False)
        # MiniMax-M2 normalises each row's whole q and k (its family_config says so), Qwen3 each
        # head: the norms' widths differ, and so does what the prologue computes.
        self.norm_over_heads = getattr(config.family_config, "qk_norm_over_heads", False)
        if config.qk_norm:
            q_width, k_width = (self.heads, self.kv_heads) if self.norm_over_heads else (1, 1)
            self.q_norm = RMSNorm(q_width * self.head_dim, config.rms_norm_eps)
            self.k_norm = RMSNorm(k_width * self.head_dim, config.rms_norm_eps)
        else:
            self.q_norm = self.k_norm = None
        # Rotary on each head's first rotary_dim channels (MiniMax-M2 rotates half of them).
        self.rotary_dim = 2 * len(config.rope_inv_freq)
        self.scale = config.softmax_scale
        self.eps = config.rms_norm_eps
        self.k_scale = self.v_scale = 1.0  # an FP8 cache's scales (module docstring)
        self.qkv: PackedLinear | None = None  # set by pack_qkv
        # gpt-oss: a learned sink logit per head (a parameter there) and a sliding window.
        self.sinks: torch.Tensor | None = None
        self.window: int | None = None

    def pack_qkv(self) -> None:
        """q, k and v as one GEMM (model/layers/packed.py); FP8 projections pack too when each
        one's rows end on a scale block boundary, otherwise they run as three GEMMs."""
        self.qkv = PackedLinear.of((self.q_proj, self.k_proj, self.v_proj))

    def takes_fp8_rows(self, h: torch.Tensor) -> bool:
        """Whether the norm before this layer may hand `forward` its rows quantized for the
        packed FP8 q/k/v GEMM (ops.quantizes_for_gemm), saving that GEMM's quantize launch."""
        return self.qkv is not None and self.qkv.takes_fp8_rows(h)

    def forward(
        self,
        x: torch.Tensor | Fp8Rows,
        meta: AttentionMetadata,
        rotary: Rotary,
        cache: LayerCache,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        rows = x.shape[0]
        if self.qkv is not None:
            qkv = self.qkv(x)
        else:
            qkv = torch.cat([self.q_proj(x), self.k_proj(x), self.v_proj(x)], dim=-1)
        k_cache, v_cache = cache
        norms = (None, None) if self.q_norm is None else (self.q_norm.weight, self.k_norm.weight)
        layout = QKVLayout(
            self.heads,
            self.kv_heads,
            self.head_dim,
            *norms,
            self.eps,
            rotary.interleave,
            self.norm_over_heads,
            self.rotary_dim,
        )
        q = ops.prepare_qkv(
            qkv, layout, *cos_sin, k_cache, v_cache, meta.slot_mapping, self.k_scale, self.v_scale
        )
        out = ops.paged_attention(  # [rows, heads, dim]
            q,
            k_cache,
            v_cache,
            meta,
            self.scale,
            self.k_scale,
            self.v_scale,
            sinks=self.sinks,
            window=self.window,
        )
        return self.o_proj(out.reshape(rows, self.heads * self.head_dim))


class MLAAttention(nn.Module):
    """Multi-head latent attention. The cache holds `[kv_lora_rank + rope_dim]` per token; keys and
    values are re-expanded from the latent with kv_b_proj when attending."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.heads = c.num_heads
        self.nope, self.rope, self.v_dim = c.qk_nope_head_dim, c.qk_rope_head_dim, c.v_head_dim
        self.kv_lora_rank = c.kv_lora_rank
        q_dim = self.heads * (self.nope + self.rope)
        if c.q_lora_rank is None:
            self.q_proj = nn.Linear(c.hidden_size, q_dim, bias=False)
        else:
            self.q_a_proj = nn.Linear(c.hidden_size, c.q_lora_rank, bias=c.attention_bias)
            self.q_a_layernorm = RMSNorm(c.q_lora_rank, 1e-6)
            self.q_b_proj = nn.Linear(c.q_lora_rank, q_dim, bias=False)
        self.q_lora = c.q_lora_rank is not None
        self.kv_a_proj_with_mqa = nn.Linear(
            c.hidden_size, c.kv_lora_rank + self.rope, bias=c.attention_bias
        )
        self.kv_a_layernorm = RMSNorm(c.kv_lora_rank, 1e-6)
        self.kv_b_proj = nn.Linear(
            c.kv_lora_rank, self.heads * (self.nope + self.v_dim), bias=False
        )
        self.o_proj = nn.Linear(self.heads * self.v_dim, c.hidden_size, bias=c.attention_bias)
        self.scale = c.softmax_scale
        # An FP8 latent cache's one scale: the cached rows are keys and values at once (vLLM's
        # MLA reads k_scale alone too).
        self.k_scale = 1.0

    def takes_fp8_rows(self, h: torch.Tensor) -> bool:
        """As GQA's: both projections of the layer input (q_a or q, kv_a) FP8 w8a8 GEMMs."""
        inputs = (self.q_a_proj if self.q_lora else self.q_proj, self.kv_a_proj_with_mqa)
        return all(
            isinstance(p, Fp8Linear)
            and ops.quantizes_for_gemm(h, p.weight, p.weight_scale_inv, p.block)
            for p in inputs
        )

    def project(
        self,
        x: torch.Tensor | Fp8Rows,
        meta: AttentionMetadata,
        rotary: Rotary,
        cache: LayerCache,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor | None, torch.Tensor, torch.Tensor]:
        """The rows' queries, their latents written into the cache -> (q_a_layernorm's output,
        None without q_lora_rank; q_nope [rows, H, nope]; q_pe [rows, H, rope], rotated)."""
        rows = x.shape[0]
        q_latent = self.q_a_layernorm(self.q_a_proj(x)) if self.q_lora else None
        q = self.q_b_proj(q_latent) if self.q_lora else self.q_proj(x)
        q = q.view(rows, self.heads, self.nope + self.rope)
        q_nope, q_pe = q.split([self.nope, self.rope], dim=-1)
        latent, k_pe = self.kv_a_proj_with_mqa(x).split([self.kv_lora_rank, self.rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        cos, sin = cos_sin
        q_pe = rotary.rotate(q_pe, cos, sin)
        k_pe = rotary.rotate(k_pe[:, None, :], cos, sin)  # [rows, 1, rope]
        ops.write_kv(
            cache[0],
            torch.cat((latent[:, None, :], k_pe), dim=-1),
            meta.slot_mapping,
            self.k_scale,
        )
        return q_latent, q_nope, q_pe

    def absorb(self, q_nope: torch.Tensor, q_pe: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """kv_b_proj's key part folded into the query: (q [rows, H, L + R] to attend straight
        over the cached [latent, rope key] rows, w_uv [H, v, L] to apply to the output's latent
        part). q_nope . (W_uk c) = (W_uk^T q_nope) . c."""
        w = linear_weight(self.kv_b_proj, q_nope.dtype)
        w = w.view(self.heads, self.nope + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w[:, : self.nope], w[:, self.nope :]  # [H, nope, L], [H, v, L]
        q_latent = torch.einsum("rhn,hnl->rhl", q_nope, w_uk)
        return torch.cat((q_latent, q_pe), dim=-1), w_uv

    def forward(
        self,
        x: torch.Tensor | Fp8Rows,
        meta: AttentionMetadata,
        rotary: Rotary,
        cache: LayerCache,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        rows = x.shape[0]
        _, q_nope, q_pe = self.project(x, meta, rotary, cache, cos_sin)
        latent_cache, _ = cache
        if meta.batched is not None:
            return self._absorbed(q_nope, q_pe, latent_cache, meta)
        q = torch.cat((q_nope, q_pe), dim=-1)
        out = q.new_zeros(rows, self.heads, self.v_dim)
        for seg in meta.segments:
            # [ctx, L + R]
            cached = ops.gather_kv(latent_cache, seg.block_table, seg.context_len)[:, 0]
            cached = ops.dequantize_kv(cached, self.k_scale, q.dtype)
            ctx_latent, ctx_pe = cached.split([self.kv_lora_rank, self.rope], dim=-1)
            kv = self.kv_b_proj(ctx_latent).view(-1, self.heads, self.nope + self.v_dim)
            k_nope, v = kv.split([self.nope, self.v_dim], dim=-1)
            k = torch.cat((k_nope, ctx_pe[:, None, :].expand(-1, self.heads, -1)), dim=-1)
            out[seg.row_start : seg.row_end] = ops.causal_attention(
                q[seg.row_start : seg.row_end], k, v, self.scale
            )
        return self.o_proj(out.reshape(rows, self.heads * self.v_dim))

    def _absorbed(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Attention in the latent space: kv_b_proj's key part is folded into the query and its
        value part applied after, so every head attends straight over the cached
        [latent, rope key] rows as one shared KV head (MQA). One batched kernel launch, no
        per-sequence expansion, and CUDA-graph capturable. Equal to the expanded form:
        q_nope . (W_uk c) = (W_uk^T q_nope) . c."""
        rows = q_nope.shape[0]
        q, w_uv = self.absorb(q_nope, q_pe)  # [rows, H, L + R]
        # Values are the latent part of the same cached rows; the rope part of the output is unused.
        out = ops.paged_attention(
            q, latent_cache, latent_cache, meta, self.scale, self.k_scale, self.k_scale
        )
        out = torch.einsum("rhl,hvl->rhv", out[..., : self.kv_lora_rank], w_uv)
        return self.o_proj(out.reshape(rows, self.heads * self.v_dim))


def make_attention(config: ModelConfig) -> nn.Module:
    return MLAAttention(config) if config.attention == "mla" else GQAAttention(config)
