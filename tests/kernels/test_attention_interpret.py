"""Paged attention over an FP8 (float8_e4m3fn) cache (kernels/triton/attention.py) on CPU under
Triton's interpreter (TRITON_INTERPRET=1, numpy), against `reference.paged_attention` over the
dequantized cache in float64.

The FP8 path casts the cache's bytes straight to the dots' dtype (float16, or float32 for a
float32 q), folds k_scale into the score scale and v_scale into the output, runs whole tiles
without token masks and loads K unmasked where the head dim needs no padding. Every cache slot
no sequence's context covers (block 0, which the tables' padding points at, and each last
block's unwritten tail) holds the NaN byte here. The interpreter reads that byte as +-480 (its
e4m3 conversion has no NaN), so this shows such slots get no weight; that their NaN stays out
is tests/gpu/test_kv_fp8.py's (`test_fp8_attention_ignores_nan_in_uncovered_slots`).

Cases: decode (one row, contexts across tile and block edges, split over programs), prefill and
chunked prefill (causal rows), decode split over several programs merged by the combine kernel
with rows of graph padding (zero), Qwen3-MoE's GQA (32 / 4 heads, dim 128) and one KV head of dim
80 (MLA's latent: padded dims, masked K), a scale of 1 and others; float16 and float32 q. bf16
is tests/gpu/test_kv_fp8.py's (the interpreter's bf16 is unreliable,
tests/kernels/test_fp4_kernel_interpret.py).

Runs in a subprocess, as the variable must be set before any @triton.jit function is defined.
Needs Triton (skipped without it) and an interpreter that runs on this numpy (Triton 3.6's
fails on numpy 2.4's size-1 arrays for every kernel with a loop; 3.9's runs). Half a minute."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

INTERPRETED_CASES = r"""
import math

import torch

from afdserve.kernels.reference import layers as reference

from afdserve.kernels.triton import attention as triton_attention
from afdserve.kernels.metadata import AttentionMetadata, Segment, batch_segments

FP8 = torch.float8_e4m3fn


def fp8_case(query_lens, context_lens, heads, kv_heads, dim, dtype, scales, seed):
    # Blocks 1.. shuffled over the sequences; block 0 and every slot past a context hold NaN.
    gen = torch.Generator().manual_seed(seed)
    block = 16
    needs = [math.ceil(c / block) for c in context_lens]
    perm = (torch.randperm(sum(needs), generator=gen) + 1).tolist()
    shape = (sum(needs) + 1, block, kv_heads, dim)
    caches = [reference.quantize_kv(torch.randn(shape, generator=gen), FP8, s) for s in scales]
    for cache in caches:
        cache.view(torch.uint8)[0] = 0x7F
    segments, row, used = [], 0, 0
    for q_len, ctx, n in zip(query_lens, context_lens, needs):
        blocks = perm[used : used + n]
        used += n
        for cache in caches:
            cache.view(torch.uint8)[blocks[-1], ctx - (n - 1) * block :] = 0x7F
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
    return q, caches[0], caches[1], meta


CASES = {
    "decode": ([1] * 5, [1, 16, 17, 150, 400]),
    "prefill": ([37, 1], [37, 50]),
    "chunked": ([5, 20], [70, 20]),
}
SHAPES = [(32, 4, 128), (16, 1, 80)]
TOL = {torch.float16: 1e-3, torch.float32: 1e-5}
for dtype in (torch.float16, torch.float32):
    for name, (query_lens, context_lens) in CASES.items():
        for heads, kv_heads, dim in SHAPES:
            for scales in ((1.0, 1.0), (0.05, 0.03)):
                q, k8, v8, meta = fp8_case(query_lens, context_lens, heads, kv_heads, dim,
                                           dtype, scales, seed=len(name) + dim)
                out = triton_attention.paged_attention(q, k8, v8, meta, dim**-0.5, *scales)
                k, v = ((c.float() * s).double() for c, s in zip((k8, v8), scales))
                ref = reference.paged_attention(q.double(), k, v, meta, dim**-0.5)
                err = float((out.double() - ref).norm() / ref.norm())
                label = (dtype, name, heads, kv_heads, dim, scales)
                assert out.dtype == dtype and torch.isfinite(out).all(), label
                assert err < TOL[dtype], (label, err)
# Slices merged by the combine kernel (the CPU's one "SM" asks for many programs per SM), and 3
# rows of graph padding past the segments' rows: the covered rows as without them, the padding
# zero (their lse is never written nor read).
q, k8, v8, meta = fp8_case([1] * 5, [1, 16, 17, 150, 400], 32, 4, 128, torch.float16,
                           (0.05, 0.03), seed=3)
many = triton_attention.Launch(block_n=16, programs_per_sm=64)
splits, _ = triton_attention.plan_splits(5, 4, 1, 400, 1, many)
assert splits > 1, splits
q_pad = torch.cat([q, torch.randn(3, 32, 128).half()])
out = triton_attention.paged_attention(q_pad, k8, v8, meta, 128**-0.5, 0.05, 0.03, many)
k, v = ((c.float() * s).double() for c, s in zip((k8, v8), (0.05, 0.03)))
ref = reference.paged_attention(q.double(), k, v, meta, 128**-0.5)
assert float((out[:5].double() - ref).norm() / ref.norm()) < TOL[torch.float16]
assert torch.equal(out[5:], torch.zeros_like(out[5:]))
# The flat grid (a program per query block of the step): a long chunk beside decodes, and a
# mixed graph's layout, a segment per row with most of them empty and the batch's whole length
# as the longest query; both would launch more than twice the programs a segment each.
q, k8, v8, meta = fp8_case([40, 1, 1, 1, 1, 1], [90, 5, 17, 33, 64, 120], 32, 4, 128,
                           torch.float16, (0.05, 0.03), seed=5)
rows, block_q = q.shape[0], triton_attention.query_block(False, 8, 128)
assert 6 * -(-40 // block_q) > 2 * triton_attention.flat_blocks(rows, 6, block_q)
out = triton_attention.paged_attention(q, k8, v8, meta, 128**-0.5, 0.05, 0.03)
k, v = ((c.float() * s).double() for c, s in zip((k8, v8), (0.05, 0.03)))
ref = reference.paged_attention(q.double(), k, v, meta, 128**-0.5)
assert float((out.double() - ref).norm() / ref.norm()) < TOL[torch.float16]
# As a mixed graph launches it, through the graph runner's own static buffers: `rows`
# segments, the real ones first, then empty ones, the whole batch as the longest query.
from afdserve.engine.cuda_graphs import UbatchBuffers

buffers = UbatchBuffers(rows, meta.batched.block_tables.shape[1], torch.device("cpu"))
buffers.load(meta.batched, rows, rows)
graph = buffers.batched(rows, rows, 4096)
graph_meta = AttentionMetadata(meta.positions, meta.slot_mapping, (), graph)
# In one slice of the context, and in slices merged by the combine kernel.
for launch in (None, triton_attention.Launch(block_n=16, programs_per_sm=1024)):
    out = triton_attention.paged_attention(q, k8, v8, graph_meta, 128**-0.5, 0.05, 0.03, launch)
    assert float((out.double() - ref).norm() / ref.norm()) < TOL[torch.float16], launch
print("ok")
"""


def interpreter_runs() -> bool:
    """Whether this Triton's interpreter runs a kernel with a loop on this numpy."""
    probe = r"""
import torch, triton, triton.language as tl

@triton.jit
def add(x, n):
    for i in range(0, tl.load(n)):
        tl.store(x, tl.load(x) + 1)

x, n = torch.zeros(1), torch.full((1,), 2, dtype=torch.int32)
add[(1,)](x, n)
assert x.item() == 2
"""
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True, timeout=120)
    return run.returncode == 0


def test_fp8_cache_under_the_interpreter() -> None:
    if not interpreter_runs():
        pytest.skip("this Triton's interpreter cannot run a loop on this numpy")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, "-c", INTERPRETED_CASES],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
