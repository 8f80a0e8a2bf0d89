"""The full-attention layers of the Gated DeltaNet hybrids: GQA over the paged cache with a
sigmoid output gate (q_proj yields each head's query and its gate), q/k norms centred on zero
(the weight is stored as gain - 1) and rotary on the first `rotary_dim` channels of each head."""

from __future__ import annotations

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig


class ZeroCenteredRMSNorm(nn.Module):
    """x / rms(x) * (1 + weight), in float32, rounded once to x's dtype (transformers' order)."""

    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.zero_centred_rms_norm(x, self.weight, self.eps)[0]

    def add(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(the norm of h + delta, h + delta): the residual add in the norm's launch."""
        return ops.zero_centred_rms_norm(h, self.weight, self.eps, delta)


class GatedAttention(nn.Module):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config
        self.heads, self.kv_heads, self.head_dim = c.num_heads, c.num_kv_heads, c.head_dim
        self.rotary_dim = c.family_config.rotary_dim
        bias = c.attention_bias
        self.q_proj = nn.Linear(c.hidden_size, 2 * self.heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(c.hidden_size, self.kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.heads * self.head_dim, c.hidden_size, bias=bias)
        self.q_norm = ZeroCenteredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.k_norm = ZeroCenteredRMSNorm(self.head_dim, c.rms_norm_eps)
        self.scale = c.softmax_scale

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        turned = ops.rotate(x[..., : self.rotary_dim].contiguous(), cos, sin, False)
        return torch.cat((turned, x[..., self.rotary_dim :]), dim=-1)

    def forward(
        self,
        x: torch.Tensor,
        meta: AttentionMetadata,
        cache: tuple[torch.Tensor, torch.Tensor],
        cos_sin: tuple[torch.Tensor, torch.Tensor],
    ) -> torch.Tensor:
        rows, d = x.shape[0], self.head_dim
        q, gate = self.q_proj(x).view(rows, self.heads, 2 * d).split(d, dim=-1)
        q = self._rotate(self.q_norm(q), *cos_sin)
        k = self._rotate(self.k_norm(self.k_proj(x).view(rows, self.kv_heads, d)), *cos_sin)
        v = self.v_proj(x).view(rows, self.kv_heads, d)
        k_cache, v_cache = cache
        ops.write_kv(k_cache, k, meta.slot_mapping)
        ops.write_kv(v_cache, v, meta.slot_mapping)
        out = ops.paged_attention(q.contiguous(), k_cache, v_cache, meta, self.scale)
        out = out.reshape(rows, self.heads * d) * torch.sigmoid(gate.flatten(1))
        return self.o_proj(out)
