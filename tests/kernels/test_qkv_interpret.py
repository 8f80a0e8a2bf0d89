"""The fused GQA prologue (kernels/triton/qkv.py) under Triton's interpreter (TRITON_INTERPRET=1,
numpy) on CPU, against `reference.prepare_qkv`: q and both whole caches (pad rows, slot -1, write
nothing). Layouts: Qwen3's per-head norms over the whole head's rotary; MiniMax-M2's norms over the
row's whole q and k (weights of heads * head_dim) with rotary on half of each head, the rest passed
through; the partial rotary with no norm (bit for bit) and interleaved; each at one row a program
and in prefill's tiles of several rows. float32 and float16 (the
interpreter's bf16 is unreliable, and so is its float8_e4m3fn cast, which rounds 1.97 to 1.0: the
FP8 cache is tests/gpu/test_qkv_kernel.py's, which runs the same layouts compiled). In a
subprocess: the variable must be set before any @triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.metadata import QKVLayout
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.triton import qkv as triton_qkv


def case(heads, kv_heads, dim, rot, norm, over_heads, interleave, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    rows, block = 6, 4
    width = (heads + 2 * kv_heads) * dim
    qkv = (torch.randn(rows, width + 8, generator=gen) * 2).to(dtype)[:, 4 : 4 + width]
    q_w, k_w = ((heads if over_heads else 1) * dim, (kv_heads if over_heads else 1) * dim)
    norms = [(1 + 0.2 * torch.randn(w, generator=gen)).to(dtype) for w in (q_w, k_w)]
    norms = norms if norm else [None, None]
    inv_freq = 1e4 ** (-torch.arange(0, rot, 2, dtype=torch.float32) / rot)
    angles = torch.randint(0, 4096, (rows,), generator=gen).float()[:, None] * inv_freq
    shape = (rows // block + 3, block, kv_heads, dim)
    slots = torch.randperm(shape[0] * block, generator=gen)[:rows]
    slots[::3] = -1
    caches = [torch.randn(shape, generator=gen).to(dtype) for _ in "kv"]
    layout = QKVLayout(heads, kv_heads, dim, *norms, 1e-6, interleave, over_heads, rot)
    return (qkv, layout, angles.cos(), angles.sin(), *caches, slots)


def check(args, exact):
    qkv, layout, cos, sin, k_cache, v_cache, slots = args
    mine = [c.clone() for c in (k_cache, v_cache)]
    theirs = [c.clone() for c in (k_cache, v_cache)]
    got = triton_qkv.prepare_qkv(qkv, layout, cos, sin, *mine, slots)
    want = reference.prepare_qkv(qkv, layout, cos, sin, *theirs, slots)
    assert torch.equal(mine[1], theirs[1])  # v: a copy
    for a, b in [(got, want.to(got.dtype)), (mine[0], theirs[0])]:
        if exact:
            assert torch.equal(a, b), layout
        else:  # the norms' sums in another order: a few ulps of each row's largest value
            ulp = torch.finfo(a.dtype).eps * b.double().abs().max()
            assert float((a.double() - b.double()).abs().max()) <= 8 * ulp, layout


f32, f16 = torch.float32, torch.float16
# heads, kv_heads, dim, rotary width, norm, over heads, interleave, dtype
CASES = [
    (4, 2, 32, 32, True, False, False, f32),  # Qwen3
    (4, 2, 32, 16, True, True, False, f32),  # MiniMax-M2 (its rotary 64 of 128)
    (6, 2, 64, 32, True, True, False, f16),
    (4, 2, 32, 16, True, False, False, f16),  # per-head norm, partial rotary
    (4, 1, 48, 16, False, False, False, f32),  # partial, no norm: bit for bit
    (4, 2, 32, 16, False, False, True, f16),  # interleaved, partial
]
for seed, (h, kv, d, rot, norm, over, inter, dt) in enumerate(CASES):
    check(case(h, kv, d, rot, norm, over, inter, dt, seed), exact=not norm)
# Prefill's tiles of several rows: 6 rows as a tile of 4 and a partial one (pads in both).
triton_qkv.PREFILL_FROM, triton_qkv.PREFILL_ROWS = 4, 4
for seed, (h, kv, d, rot, norm, over, inter, dt) in enumerate(CASES):
    check(case(h, kv, d, rot, norm, over, inter, dt, seed + 100), exact=not norm)
print("ok")
"""


def test_qkv_prologue_layouts_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600)
    output = run.stdout + run.stderr[-3000:]
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), output
