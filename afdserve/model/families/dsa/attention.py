"""MLA over the tokens the indexer selects (DeepSeek Sparse Attention).

`DSAAttention` is the decoder family's `MLAAttention` (same projections, names and latent cache
rows) plus, on layers that run one, the lightning indexer (indexer.py). A step writes the rows'
latents and indexer keys into the layer's pages, selects each row's `index_topk` slots (or takes
the selection an earlier layer made: GLM-5's shared layers), and attends in the latent space
(kv_b_proj's key part folded into the query, its value part applied after) over exactly those
slots: a fixed-width gather `[rows, index_topk, latent]`, the same shapes in prefill and decode.
On CUDA both the selection and the attention run in Triton kernels over the pages
(kernels/triton/dsa_indexer.py, dsa_attention.py), every row at once from the device segments,
prefill rows alike; the torch forms here stay the CPU path and their reference.
"""

from __future__ import annotations

import torch

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.families.dsa.indexer import (
    Indexer,
    select_batched,
    select_fast,
    select_per_segment,
    take,
)
from afdserve.model.layers.attention import LayerCache, MLAAttention
from afdserve.model.layers.common import Rotary

# Query rows attended at once: bounds the [rows, index_topk, latent] gather of a long prefill.
ATTEND_ROWS = 256


class DSAAttention(MLAAttention):
    def __init__(self, config: ModelConfig, layer: int) -> None:
        super().__init__(config)
        has_indexer = config.family_config.has_indexer(layer)
        self.indexer = Indexer(config) if has_indexer else None

    def takes_fp8_rows(self, h: torch.Tensor) -> bool:
        """Never: the indexer's float32 head weights read the layer input as it is."""
        return False

    def forward(  # type: ignore[override]
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        rotary: Rotary,
        cache: LayerCache,
        cos_sin: tuple[torch.Tensor, torch.Tensor],
        selected: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """x [rows, hidden] -> (out [rows, hidden], the selection [rows, index_topk] of cache
        slots this layer attended, -1 for none). `selected`: the last full layer's, which a
        layer without an indexer reuses."""
        rows = x.shape[0]
        q_latent, q_nope, q_pe = self.project(x, meta, rotary, cache, cos_sin)
        latent_cache, keys_cache = cache
        cos, sin = cos_sin
        if self.indexer is not None:
            ops.write_kv(keys_cache, self.indexer.keys(x, cos, sin), meta.slot_mapping)
            selected = self._select(x, q_latent, cos, sin, keys_cache, meta)
        elif selected is None:
            raise ValueError("a DSA layer without an indexer needs an earlier layer's selection")
        out = self._attend(q_nope, q_pe, latent_cache, selected)
        return self.o_proj(out.reshape(rows, self.heads * self.v_dim)), selected

    def _select(
        self,
        x: torch.Tensor,
        q_latent: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        keys_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """On CUDA the Triton kernels (`select_fast`). Otherwise per sequence from the host
        segments where a step has them and runs prefill rows (each sequence's keys gathered
        once), else every row at once from the device segments (decode, and the steps a CUDA
        graph captures, whose host segments are empty)."""
        q, w = self.indexer.queries(x, q_latent, cos, sin)
        fast = select_fast(self.indexer, q, w, keys_cache, meta)
        if fast is not None:
            return fast
        batched = meta.batched is not None and (
            not meta.segments or meta.batched.max_query_len <= 1
        )
        if batched:
            return select_batched(self.indexer, q, w, keys_cache, meta)
        return select_per_segment(self.indexer, q, w, keys_cache, meta)

    def _attend(
        self,
        q_nope: torch.Tensor,
        q_pe: torch.Tensor,
        latent_cache: torch.Tensor,
        selected: torch.Tensor,
    ) -> torch.Tensor:
        """Absorbed MLA (`MLAAttention.absorb`) over each row's selected slots: keys and values
        are the cached latents themselves, read by slot in one Triton launch on CUDA.
        -> [rows, heads, v_dim]; rows with nothing selected (pad rows) give zeros."""
        q, w_uv = self.absorb(q_nope, q_pe)  # [rows, H, L + R], [H, v, L]
        out = ops.dsa_sparse_mla(
            q, latent_cache, selected, self.kv_lora_rank, self.scale, self.k_scale
        )
        if out is None:
            out = self._attend_reference(q, latent_cache, selected)
        return torch.einsum("rhl,hvl->rhv", out, w_uv)

    def _attend_reference(
        self, q: torch.Tensor, latent_cache: torch.Tensor, selected: torch.Tensor
    ) -> torch.Tensor:
        """The torch form (CPU), in row chunks of ATTEND_ROWS: a fixed-width gather of the
        selected latents -> the output's latent part [rows, heads, kv_lora_rank]."""
        flat = latent_cache.view(-1, latent_cache.shape[-1])
        out = q.new_zeros(q.shape[0], self.heads, self.kv_lora_rank)
        for lo in range(0, q.shape[0], ATTEND_ROWS):
            hi = min(lo + ATTEND_ROWS, q.shape[0])
            slots = selected[lo:hi]
            kv = take(flat, slots.clamp(min=0))  # [r, K, L+R]
            kv = ops.dequantize_kv(kv, self.k_scale, q.dtype)
            scores = torch.einsum("rhd,rkd->rhk", q[lo:hi], kv) * self.scale
            valid = (slots >= 0)[:, None, :]
            scores = scores.masked_fill(~valid, float("-inf"))
            probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype)
            probs = probs.masked_fill(~valid, 0.0)  # a row with nothing valid: NaN -> 0
            out[lo:hi] = torch.einsum("rhk,rkl->rhl", probs, kv[..., : self.kv_lora_rank])
        return out
