"""Manifold-constrained hyper-connections (mHC): DeepSeek-V4's `hc_mult` residual streams.

A token carries `n = hc_mult` streams `h [rows, n, hidden]`. Before each block (attention, FFN) a
hyper-connection reads all streams and yields three mappings: `pre [n]` collapses the streams
into the block's one input row, `post [n]` spreads the block's output back over the streams, and
`comb [n, n]` mixes the streams themselves, pushed towards a doubly-stochastic matrix by
Sinkhorn-Knopp so that the residual path cannot grow the signal layer after layer:
`h' = post * y + comb^T h`. Everything here is per token, so it lives on the attention side and
never crosses the AFD boundary (only the collapsed row, width hidden, does).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops


def unweighted_rms_norm(x: torch.Tensor, eps: float) -> torch.Tensor:
    """x / rms(x), the statistics in float32, no weight."""
    return x * torch.rsqrt(x.float().square().mean(-1, keepdim=True) + eps).to(x.dtype)


def v4_rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """V4 keeps its norm weights in float32 and multiplies before the one cast back (the other
    families' norm casts first)."""
    normed = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + eps)
    return (weight.float() * normed).to(x.dtype)


class V4RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return v4_rms_norm(x, self.weight, self.eps)


class HyperConnection(nn.Module):
    """One block's mHC mappings: `fn [(2 + n) n, n hidden]`, `base [(2 + n) n]`, `scale [3]`."""

    def __init__(self, hidden: int, n: int, iters: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.n, self.iters, self.hc_eps, self.norm_eps = n, iters, hc_eps, norm_eps
        width = (2 + n) * n
        self.fn = nn.Parameter(torch.empty(width, n * hidden))
        self.base = nn.Parameter(torch.empty(width))
        self.scale = nn.Parameter(torch.empty(3))

    def forward(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """h [rows, n, hidden] -> (collapsed [rows, hidden], post [rows, n], comb [rows, n, n]);
        post and comb in float32, as computed."""
        n = self.n
        flat = unweighted_rms_norm(h.flatten(-2).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre_w, post_w, comb_w = mix.split([n, n, n * n], dim=-1)
        pre_b, post_b, comb_b = self.base.float().split([n, n, n * n])
        pre_s, post_s, comb_s = self.scale.float().unbind(0)
        pre = torch.sigmoid(pre_w * pre_s + pre_b) + self.hc_eps
        post = 2 * torch.sigmoid(post_w * post_s + post_b)
        logits = comb_w.view(*comb_w.shape[:-1], n, n) * comb_s + comb_b.view(n, n)
        comb = torch.softmax(logits, dim=-1) + self.hc_eps
        # Sinkhorn-Knopp: columns first, then (iters - 1) rounds of rows and columns.
        comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        for _ in range(self.iters - 1):
            comb = comb / (comb.sum(dim=-1, keepdim=True) + self.hc_eps)
            comb = comb / (comb.sum(dim=-2, keepdim=True) + self.hc_eps)
        collapsed = (pre.unsqueeze(-1) * h).sum(dim=-2).to(h.dtype)
        return collapsed, post, comb


def expand(
    h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """The streams after a block: post * y + comb^T h. comb is read by its first index (sum_j
    comb[j, k] h[j]); Sinkhorn leaves it non-symmetric, so the direction matters."""
    dtype = h.dtype
    return post.to(dtype).unsqueeze(-1) * y.unsqueeze(-2) + torch.matmul(
        comb.to(dtype).transpose(-1, -2), h
    )


def update_streams(
    h: torch.Tensor, y: torch.Tensor, post: torch.Tensor, comb: torch.Tensor
) -> torch.Tensor:
    """`expand` where no site follows (after the last layer): one launch on CUDA
    (ops.mhc_expand), the torch form elsewhere."""
    fused = ops.mhc_expand(h, y, post, comb)
    return expand(h, y, post, comb) if fused is None else fused


StreamUpdate = tuple[torch.Tensor, torch.Tensor, torch.Tensor]  # y, post, comb


def connect(
    hc: HyperConnection, norm: V4RMSNorm, h: torch.Tensor, update: StreamUpdate | None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One mHC site: the streams h [rows, n, hidden] updated by the previous block's output
    (`update`: y and that site's post, comb; None at layer 0), then `hc`'s mappings and `norm` of
    its collapse -> (streams, norm(collapsed) [rows, hidden], post, comb). Two fused launches on
    CUDA (ops.hyper_connection), about sixty small ones in the torch form here."""
    eps = (hc.hc_eps, hc.norm_eps, norm.eps)
    fused = ops.hyper_connection(h, update, hc.fn, hc.base, hc.scale, norm.weight, hc.iters, eps)
    if fused is not None:
        return fused
    if update is not None:
        h = expand(h, *update)
    collapsed, post, comb = hc(h)
    return h, norm(collapsed), post, comb


class HyperHead(nn.Module):
    """The final collapse of the streams before the model's norm: its own `pre` only."""

    def __init__(self, hidden: int, n: int, hc_eps: float, norm_eps: float) -> None:
        super().__init__()
        self.hc_eps, self.norm_eps = hc_eps, norm_eps
        self.fn = nn.Parameter(torch.empty(n, n * hidden))
        self.base = nn.Parameter(torch.empty(n))
        self.scale = nn.Parameter(torch.empty(1))

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        flat = unweighted_rms_norm(h.flatten(-2).float(), self.norm_eps)
        mix = F.linear(flat, self.fn.float())
        pre = torch.sigmoid(mix * self.scale.float() + self.base.float()) + self.hc_eps
        return (pre.unsqueeze(-1) * h).sum(dim=-2).to(h.dtype)
