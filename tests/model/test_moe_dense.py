"""The sync-free routed-expert path that CUDA graphs capture in float32 equals the reference."""

from __future__ import annotations

import torch

from afdserve.kernels.reference.layers import moe_experts, moe_experts_dense


def test_dense_experts_equal_reference():
    gen = torch.Generator().manual_seed(0)
    rows, hidden, inter, experts, k = 9, 16, 8, 6, 2
    x = torch.randn(rows, hidden, generator=gen)
    gate_up = torch.randn(experts, 2 * inter, hidden, generator=gen)
    down = torch.randn(experts, hidden, inter, generator=gen)
    scores = torch.randn(rows, experts, generator=gen).softmax(-1)
    topk_w, topk_ids = scores.topk(k, dim=-1)
    want = moe_experts(x, topk_ids, topk_w, gate_up, down)
    got = moe_experts_dense(x, topk_ids, topk_w, gate_up, down)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
