"""gpt-oss's attention in the Triton paged-attention kernel (kernels/triton/attention.py): a
learned sink logit per head in the softmax's denominator, and sliding-window layers whose
query sees only its last `window` keys, on CPU under Triton's interpreter against
`reference.paged_attention` in float64.

Cases: decode with contexts inside, at and past the window; prefill and chunked prefill whose
rows' windows start at different keys of one tile; sinks alone, the window alone and both;
the split path (many programs per "SM", merged by the combine kernel, which adds the sink once)
with rows of graph padding (zero); a float8_e4m3fn cache. Skipped without Triton, or where its
interpreter cannot run a loop on this numpy (3.6 on numpy 2.4; run it with numpy < 2.4)."""

from __future__ import annotations

import pytest

from tests.kernels.interpret import run_interpreted
from tests.kernels.test_attention_interpret import interpreter_runs

CASES = r"""
import math

import torch

from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.triton import attention as triton_attention


def case(query_lens, context_lens, heads, kv_heads, dim, dtype, seed, cache_dtype=None):
    gen = torch.Generator().manual_seed(seed)
    block = 16
    needs = [math.ceil(c / block) for c in context_lens]
    perm = (torch.randperm(sum(needs), generator=gen) + 1).tolist()
    shape = (sum(needs) + 1, block, kv_heads, dim)
    k = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    v = torch.randn(shape, generator=gen).to(cache_dtype or dtype)
    segments, row, used = [], 0, 0
    for q_len, ctx, n in zip(query_lens, context_lens, needs):
        blocks = perm[used : used + n]
        used += n
        table = torch.tensor(blocks + [0] * (max(needs) - n), dtype=torch.int32)
        segments.append(Segment(row, row + q_len, table, ctx))
        row += q_len
    meta = AttentionMetadata(
        positions=torch.zeros(row, dtype=torch.int64),
        slot_mapping=torch.zeros(row, dtype=torch.int64),
        segments=tuple(segments),
        batched=batch_segments(tuple(segments), torch.device("cpu")),
    )
    q = torch.randn(row, heads, dim, generator=gen).to(dtype)
    sinks = (torch.randn(heads, generator=gen) * 2).to(dtype)
    return q, k, v, sinks, meta


def check(out, q, k, v, sinks, window, meta, dim, tol, label):
    ref = reference.paged_attention(
        q.double(), k.double(), v.double(), meta, dim**-0.5,
        sinks=None if sinks is None else sinks.double(), window=window,
    )
    rows = ref.shape[0]
    err = float((out[:rows].double() - ref).norm() / ref.norm())
    assert torch.isfinite(out).all(), label
    assert err < tol, (label, err)


CASES = {
    "decode": ([1] * 5, [1, 7, 8, 9, 150]),
    "prefill": ([37, 1], [37, 50]),
    "chunked": ([20, 5], [70, 20]),
}
TOL = {torch.float16: 2e-3, torch.float32: 1e-5}
for dtype in (torch.float16, torch.float32):
    for name, (query_lens, context_lens) in CASES.items():
        for heads, kv_heads, dim in ((8, 2, 64), (4, 4, 32)):
            for use_sinks, window in ((True, None), (False, 8), (True, 8), (True, 23)):
                q, k, v, sinks, meta = case(
                    query_lens, context_lens, heads, kv_heads, dim, dtype, seed=len(name) + dim
                )
                sinks = sinks if use_sinks else None
                out = triton_attention.paged_attention(
                    q, k, v, meta, dim**-0.5, sinks=sinks, window=window
                )
                label = (dtype, name, heads, kv_heads, dim, use_sinks, window)
                check(out, q, k, v, sinks, window, meta, dim, TOL[dtype], label)

# The split path: slices merged by the combine kernel, which adds each head's sink once; 3 rows
# of graph padding past the segments' rows come out zero.
many = triton_attention.Launch(block_n=16, programs_per_sm=64)
for window in (None, 40):
    q, k, v, sinks, meta = case([1] * 4, [1, 16, 90, 400], 8, 2, 64, torch.float32, seed=5)
    span = 400 if window is None else window
    assert triton_attention.plan_splits(4, 2, 1, span, 1, many)[0] > 1
    q_pad = torch.cat([q, torch.randn(3, 8, 64)])
    out = triton_attention.paged_attention(
        q_pad, k, v, meta, 64**-0.5, launch=many, sinks=sinks, window=window
    )
    check(out, q, k, v, sinks, window, meta, 64, 1e-5, ("split", window))
    assert torch.equal(out[4:], torch.zeros_like(out[4:]))

# An FP8 cache (its own decode launch, unmasked whole tiles), sinks and a window.
FP8 = torch.float8_e4m3fn
for name, (query_lens, context_lens) in CASES.items():
    q, k8, v8, sinks, meta = case(
        query_lens, context_lens, 8, 2, 64, torch.float16, seed=9, cache_dtype=FP8
    )
    out = triton_attention.paged_attention(q, k8, v8, meta, 64**-0.5, sinks=sinks, window=8)
    check(out, q, k8.float(), v8.float(), sinks, 8, meta, 64, 2e-3, ("fp8", name))
print("ok")
"""


def test_sinks_and_window_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    if not interpreter_runs():
        pytest.skip("this Triton's interpreter cannot run a loop on this numpy")
    run = run_interpreted(CASES, timeout=900)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
