"""Paged attention (kernels/triton/attention.py) over wide heads under Triton's interpreter:
Kimi-Linear's NoPE MLA reads its 576-channel latent whole, 32 query heads over one KV head,
with the launch and query block chosen for wide heads (`WIDE_LAUNCH`, `query_block`: tiles
that fit sm_90's shared memory), decode and prefill rows, against the torch reference in
float64."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

CASES = r"""
import math, torch
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.triton import attention as ta
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
gen = torch.Generator().manual_seed(0)
block, heads, kv_heads, dim = 16, 32, 1, 576
for query_lens, context_lens in (([1, 1], [40, 17]), ([5, 1], [20, 33])):
    needs = [math.ceil(c / block) for c in context_lens]
    cache = torch.randn(sum(needs) + 1, block, kv_heads, dim, generator=gen)
    segments, row, used = [], 0, 1
    width = max(needs)
    for q, c, n in zip(query_lens, context_lens, needs):
        table = torch.zeros(width, dtype=torch.int32)
        table[:n] = torch.arange(used, used + n, dtype=torch.int32)
        segments.append(Segment(row, row + q, table, c, -1))
        row += q; used += n
    rows = row
    q = torch.randn(rows, heads, dim, generator=gen)
    positions = torch.cat([torch.arange(c - ql, c) for ql, c in zip(query_lens, context_lens)])
    segments = tuple(segments)
    batched = batch_segments(segments, torch.device("cpu"))
    meta = AttentionMetadata(positions, torch.zeros(rows, dtype=torch.int64), segments, batched)
    want = reference.paged_attention(q.double(), cache.double(), cache.double(), meta, dim ** -0.5)
    got = ta.paged_attention(q, cache, cache, meta, dim ** -0.5)
    err = (got.double() - want).abs().max().item()
    print(query_lens, context_lens, "max err", err)
    assert err < 1e-3
print("ok")
"""


def test_wide_heads_equal_the_reference() -> None:
    done = run_interpreted(CASES, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip().endswith("ok")
