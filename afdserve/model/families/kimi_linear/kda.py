"""Kimi Delta Attention: the gated delta rule with a decay per key channel (not per head), over
the same state slots and slot machinery as Gated DeltaNet (gated_deltanet/deltanet.py).

q, k, v projections -> their own short causal convolutions (SiLU) -> the delta rule with
g = -exp(A_log) * softplus(f_b(f_a(x)) + dt_bias) per channel -> RMSNorm in float32 gated by
sigmoid(g_b(g_a(x))) -> o_proj. Module names are the public checkpoint's (`f_a_proj`, `q_conv1d`).
"""

from __future__ import annotations

import torch
from torch import nn

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.config import ModelConfig
from afdserve.model.families.gated_deltanet.cache import LinearState
from afdserve.model.families.gated_deltanet.deltanet import DeltaRuleLayer


def _conv_weight(channels: int, kernel: int) -> nn.Module:
    conv = nn.Module()
    conv.weight = nn.Parameter(torch.empty(channels, 1, kernel))  # the depthwise Conv1d's
    return conv


class KimiDeltaAttention(DeltaRuleLayer):
    def __init__(self, config: ModelConfig) -> None:
        super().__init__()
        c = config.family_config
        hidden, dim, heads = config.hidden_size, c.qkv_dim, c.num_heads
        self.hk = self.hv = heads
        self.dk = self.dv = c.head_dim
        self.q_proj = nn.Linear(hidden, dim, bias=False)
        self.k_proj = nn.Linear(hidden, dim, bias=False)
        self.v_proj = nn.Linear(hidden, dim, bias=False)
        self.q_conv1d = _conv_weight(dim, c.conv_kernel)
        self.k_conv1d = _conv_weight(dim, c.conv_kernel)
        self.v_conv1d = _conv_weight(dim, c.conv_kernel)
        self.f_a_proj = nn.Linear(hidden, c.head_dim, bias=False)
        self.f_b_proj = nn.Linear(c.head_dim, dim, bias=False)
        self.dt_bias = nn.Parameter(torch.empty(dim))
        self.A_log = nn.Parameter(torch.empty(1, 1, heads, 1))
        self.b_proj = nn.Linear(hidden, heads, bias=False)
        self.g_a_proj = nn.Linear(hidden, c.head_dim, bias=False)
        self.g_b_proj = nn.Linear(c.head_dim, dim, bias=False)
        self.o_norm = nn.Module()
        self.o_norm.weight = nn.Parameter(torch.empty(c.head_dim))
        self.o_proj = nn.Linear(dim, hidden, bias=False)
        self.eps = config.rms_norm_eps

    def conv_weight(self) -> torch.Tensor:
        convs = (self.q_conv1d, self.k_conv1d, self.v_conv1d)
        return torch.cat([c.weight[:, 0] for c in convs])

    def takes_fp8_rows(self, h: torch.Tensor) -> bool:
        return False

    def _inputs(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = x.shape[0]
        qkv = torch.cat((self.q_proj(x), self.k_proj(x), self.v_proj(x)), dim=-1)
        f = self.f_b_proj(self.f_a_proj(x)).float() + self.dt_bias.float()
        f = torch.where(f > 20.0, f, torch.log(1.0 + torch.exp(f)))  # softplus, as the reference
        g = -self.A_log.float().exp().view(1, self.hv, 1) * f.view(rows, self.hv, self.dk)
        gate = self.g_b_proj(self.g_a_proj(x)).view(rows, self.hv, self.dv)
        return qkv, gate, g, torch.sigmoid(self.b_proj(x))

    def _split(self, mixed: torch.Tensor) -> tuple[torch.Tensor, ...]:
        rows = mixed.shape[0]
        return tuple(t.reshape(rows, self.hv, self.dk) for t in mixed.chunk(3, dim=-1))

    def _output(self, core: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        f = core.float()
        f = f * torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + self.eps)
        f = self.o_norm.weight.float() * f * torch.sigmoid(gate.float())
        return self.o_proj(f.to(core.dtype).flatten(1))

    def forward(  # type: ignore[override]
        self, x: torch.Tensor, meta: AttentionMetadata, rotary, cache: LinearState, cos_sin
    ) -> torch.Tensor:
        """The decoder's attention call (model/families/decoder/model.py); KDA has no rotary."""
        return super().forward(x, meta, cache)
