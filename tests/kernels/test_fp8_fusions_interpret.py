"""The launches the w8a8 FP8 path folds into others (tests/gpu/test_fp8_fusions.py on the GPU),
under Triton's interpreter (TRITON_INTERPRET=1, numpy) on CPU: the quantize launch gives the
reference's scales, and the values of a program per group; the norm that quantizes its rows
gives add_rms_norm-then-quantize_rows' values and scales bit for bit (a partial last group, a
width under one group), and the GEMM whose last K split sums the partials gives the sum launch's
bits with its tile counters back at zero; and the grouped GEMM (one launch for every group of a
grouped projection) gives each group's own GEMM's bits. fp16 rows (the interpreter computes bf16
wrongly). In a subprocess because the variable must be set before any @triton.jit function is
defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.reference import fp8
from afdserve.kernels.triton import fp8_w8a8 as w8a8
from afdserve.kernels.triton.counters import tile_counters
from afdserve.kernels.triton import norm as triton_norm

# The quantize launch: its power-of-two scales those of the reference's groups, its values those
# of a program per group (the interpreter's e4m3 conversion is not the GPU's, so the values are
# checked launch against launch; tests/gpu/test_fp8_kernels.py holds them to the reference). Over
# one program's block of groups, a partial last group, a width under one group.
for rows, width in [(3, 256), (4, 1300), (2, 96), (2, 2176)]:
    gen = torch.Generator().manual_seed(rows * width)
    x = (torch.randn(rows, width, generator=gen) * torch.logspace(-3, 3, width)).half()
    values, scales = w8a8.quantize_rows(x)
    groups = torch.nn.functional.pad(x.float(), (0, -width % 128)).unflatten(1, (-1, 128))
    want = torch.exp2(torch.ceil(torch.log2(groups.abs().amax(-1) / 448.0)))
    assert torch.equal(scales, want), (rows, width)
    w8a8.QUANTIZE_GROUPS = 1
    one_values, one_scales = w8a8.quantize_rows(x)
    w8a8.QUANTIZE_GROUPS = 8
    assert torch.equal(values.view(torch.uint8), one_values.view(torch.uint8)), (rows, width)
    assert torch.equal(scales, one_scales), (rows, width)
    print("quantize", rows, width, "ok")

for rows, width in [(3, 256), (5, 200), (2, 96)]:
    gen = torch.Generator().manual_seed(rows + width)
    h = (torch.randn(rows, width, generator=gen) * 3).half()
    delta = torch.randn(rows, width, generator=gen).half()
    weight = (torch.rand(width, generator=gen) + 0.5).half()
    normed, summed = triton_norm.add_rms_norm(h, delta, weight, 1e-6)
    values, scales = w8a8.quantize_rows(normed)
    got, got_summed = triton_norm.add_rms_norm_fp8(h, delta, weight, 1e-6)
    assert torch.equal(got.values.view(torch.uint8), values.view(torch.uint8)), (rows, width)
    assert torch.equal(got.scales, scales) and torch.equal(got_summed, summed), (rows, width)
    print("norm", rows, width, "ok")

for m, n, k, splits in [(1, 320, 1024, 4), (8, 192, 2048, 8), (3, 200, 640, 2)]:
    gen = torch.Generator().manual_seed(m + n)
    x = torch.randn(m, k, generator=gen).half()
    q, s = fp8.quantize_blockwise(torch.randn(n, k, generator=gen) * k**-0.5, (128, 128))
    for bias in (None, torch.randn(n, generator=gen).half()):
        tiles = w8a8.Tiles(16, 64, 128, splits, 4, 3)
        w8a8.REDUCE_IN_GEMM = False
        want = w8a8.fp8_linear(x, q, s, bias, tiles)
        w8a8.REDUCE_IN_GEMM = True
        for _ in range(2):
            assert torch.equal(w8a8.fp8_linear(x, q, s, bias, tiles), want), (m, n, k)
        assert int(tile_counters(q, w8a8.MAX_SPLIT_TILES).count_nonzero()) == 0
        rows = fp8.Fp8Rows(*w8a8.quantize_rows(x), x.dtype)
        assert torch.equal(w8a8.fp8_linear(rows, q, s, bias, tiles), want), (m, n, k)
    print("gemm", m, n, k, "ok")

# A grouped projection (DeepSeek-V4's output projection): group g of x's g-th k columns, one
# launch, bit for bit each group's own GEMM (same tiles and splits: the same float32 sums; the
# GPU tests hold that GEMM to the reference), rows quantized in the GEMM (m <= 16), by the quantize
# launch, and already quantized.
for m, groups, n_group, k, splits in [(1, 4, 128, 256, 2), (20, 3, 256, 384, 1)]:
    gen = torch.Generator().manual_seed(m + groups)
    x = torch.randn(m, groups * k, generator=gen).half()
    q, s = fp8.quantize_blockwise(torch.randn(groups * n_group, k, generator=gen) * k**-0.5,
                                  (128, 128))
    tiles = w8a8.Tiles(16 if m <= 16 else 32, 64, 128, splits, 4, 3)
    assert w8a8.grouped_supports(x, q, groups)
    got = w8a8.fp8_linear(x, q, s, None, tiles, groups=groups)
    assert got.shape == (m, groups * n_group)
    rows = fp8.Fp8Rows(*w8a8.quantize_rows(x), x.dtype)
    assert torch.equal(w8a8.fp8_linear(rows, q, s, None, tiles, groups=groups), got)
    for g in range(groups):
        cols, outs = slice(g * k, (g + 1) * k), slice(g * n_group, (g + 1) * n_group)
        s_g = s[g * n_group // 128:(g + 1) * n_group // 128]
        own = w8a8.fp8_linear(x[:, cols].contiguous(), q[outs], s_g, None, tiles)
        assert torch.equal(got[:, outs], own), (m, groups, g)
    print("grouped", m, groups, "ok")
"""


def test_fused_fp8_launches_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600, min_triton=(3, 7))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 12, run.stdout
