"""Building blocks shared by every family: RMSNorm, rotary embedding, the SiLU-gated MLP."""

from __future__ import annotations

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.model.config import ModelConfig
from afdserve.model.layers.packed import PackedLinear


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.rms_norm(x, self.weight, self.eps)


class Rotary(nn.Module):
    """Rotary position embedding. `interleave` rotates pairs (x0, x1), (x2, x3), ... (DeepSeek) and
    returns them de-interleaved; q and k get the same permutation, so their dot products are
    unchanged."""

    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        inv_freq = torch.tensor(config.rope_inv_freq, dtype=torch.float32)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.scaling = config.rope_attention_scaling
        self.interleave = config.rope_interleave

    def cos_sin(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [rows, dim / 2]
        return freqs.cos() * self.scaling, freqs.sin() * self.scaling

    def rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [rows, heads, dim]; cos/sin [rows, dim / 2]."""
        return ops.rotate(x, cos, sin, self.interleave)


class GatedMLP(nn.Module):
    """down(silu(gate(x)) * up(x)): dense layers and shared experts; with `limit` (DeepSeek-V4's
    swiglu_limit) gate and up are clamped first."""

    def __init__(self, hidden: int, intermediate: int, limit: float | None = None) -> None:
        super().__init__()
        self.limit = limit
        self.gate_proj = nn.Linear(hidden, intermediate, bias=False)
        self.up_proj = nn.Linear(hidden, intermediate, bias=False)
        self.down_proj = nn.Linear(intermediate, hidden, bias=False)
        self.gate_up: PackedLinear | None = None  # set by pack

    def pack(self) -> None:
        """gate and up as one GEMM (model/layers/packed.py); FP8 ones where each ends on a scale
        block. Call once the weights are allocated."""
        self.gate_up = PackedLinear.of((self.gate_proj, self.up_proj))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:  # swiglu reads the two halves as column slices
            return self.down_proj(ops.swiglu(*self.gate_up.split(x), self.limit))
        gate, up = self.gate_proj, self.up_proj
        scales = getattr(gate, "weight_scale_inv", None)  # an Fp8Linear (so is up)
        if scales is not None and ops.quantizes_for_gemm(x, gate.weight, scales, gate.block):
            x = ops.quantize_rows(x)  # once, where each w8a8 GEMM would quantize them again
        return self.down_proj(ops.swiglu(gate(x), up(x), self.limit))
