"""The w8a8 block-scaled FP8 linear layer on CUDA (DeepSeek's recipe, as vLLM runs block-FP8
checkpoints): activations quantized once per row and group of 128, then a GEMM on FP8 tensor
cores with both operands as stored. The oracle is kernels/reference/fp8.py's fp8_linear_w8a8;
the two differ only in float32 summation order and the final rounding. No host sync.

1. quantize: x [M, K] -> e4m3 rows [M, K] and a float32 power-of-two scale per row and 128-group
   [M, ceil(K / 128)] that brings the group's largest |value| into (224, 448] (the reference's
   quantize_activations; x / scale is exact). Its own launch keeps the GEMM's loop a plain
   pipelined FP8 dot; up to QUANTIZE_IN_GEMM_ROWS rows the GEMM does it per K step instead.
2. GEMM: per group of 128 along K (one activation group, one weight scale block: BN divides 128)
   the dot of the FP8 tiles, its float32 partial times the rows' and the block's scales. K is
   split at small M as in fp8_weight_only.py; the tile's last split to finish sums the partials
   in split order (`REDUCE_IN_GEMM`: each split counts itself in on a per-tile counter, and the
   last one sums, with the rounding of a separate sum launch, and zeroes the counter again).
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from afdserve.kernels.reference.fp8 import FP8_DTYPE, FP8_MAX, Fp8Rows
from afdserve.kernels.triton.counters import tile_counters
from afdserve.kernels.triton.fp8_weight_only import (
    MAX_SPLITS,
    SCALE_BLOCK,
    SUM_BLOCK,
    _sum_splits_kernel,
    as_operand,
    exact_shift,
)

GROUP = SCALE_BLOCK  # activation values per scale: one weight block's K
# Rows up to which the GEMM quantizes its x tile itself, each K step (triton_fp8.as_operand: the
# same e4m3 values and scales as the quantize launch), rather than after a quantize launch: at
# so few rows that is a few instructions per weight tile, where the launch costs a microsecond
# and more. Past them, the launch (fused, at 64 rows the GEMM took twice as long).
QUANTIZE_IN_GEMM_ROWS = 16
# Whether K splits are summed by the tile's last split (module docstring) rather than by a
# second launch, which costs a launch per split GEMM: two a layer at a batch of 1 (q/k/v and
# o_proj), one at 64 (docs/benchmarks.md, "Kernel constants").
REDUCE_IN_GEMM = True
# Groups of 128 one program of the quantize launch takes: one per program left prefill steps with
# hundreds of thousands of one-warp programs (docs/benchmarks.md, 2026-12-06; 8 the one tried).
QUANTIZE_GROUPS = 8
# Tile counters per weight (`counters.tile_counters`): a split launch has fewer tiles than
# `tiles_for`'s program target.
MAX_SPLIT_TILES = 512


@triton.jit
def _quantize_kernel(
    x_ptr,
    q_ptr,
    s_ptr,
    K,
    x_stride,
    groups,
    FP8_LIMIT: tl.constexpr,
    GROUP: tl.constexpr,
    GROUPS: tl.constexpr,
):
    # One row's GROUPS groups of GROUP columns a program, each group's scale its own.
    row = tl.program_id(0).to(tl.int64)
    g = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    c = g[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    ok = c < K
    x = tl.load(x_ptr + row * x_stride + c, mask=ok, other=0.0).to(tl.float32)
    amax = tl.maximum(tl.max(tl.abs(x), axis=1), 1e-30)
    shift = exact_shift(amax, FP8_LIMIT)
    tl.store(q_ptr + row * K + c, (x * tl.exp2(-shift)[:, None]).to(tl.float8e4nv), mask=ok)
    tl.store(s_ptr + row * groups + g, tl.exp2(shift), mask=g < groups)


@triton.jit
def _gemm_kernel(
    a_ptr,
    as_ptr,
    w_ptr,
    ws_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    M,
    N,
    K,
    groups,
    ws_stride,
    k_per_split,
    a_stride,
    as_stride,
    n_group,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    SPLIT: tl.constexpr,
    QUANTIZE: tl.constexpr,
    GROUP: tl.constexpr,
    REDUCE: tl.constexpr = False,
):
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, GROUP)
    m_ok, n_ok = m < M, n < N
    # Grouped (n_group < N): output column j belongs to group j // n_group, which reads x's
    # columns [g K, (g + 1) K) (a tile never straddles groups: BN divides n_group).
    g = tl.program_id(0) * BN // n_group
    a_rows = a_ptr + m.to(tl.int64)[:, None] * a_stride + g * K
    a_scales = as_ptr + m * as_stride + g * groups
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    # BN divides 128: the tile's columns share one row of the weight's scale grid.
    w_scales = ws_ptr + (tl.program_id(0) * BN // 128) * ws_stride
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_first = tl.program_id(2) * k_per_split  # a multiple of BK
    # A K step is BK // 128 activation groups (one weight scale block each), one dot apiece:
    # wider steps put more of the weight in flight per program without more programs.
    for k0 in range(k_first, tl.minimum(K, k_first + k_per_split), BK):
        for sub in tl.static_range(BK // GROUP):
            kk = k0 + sub * GROUP + k
            k_ok = kk < K
            a = tl.load(a_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_rows + kk[None, :], mask=n_ok[:, None] & k_ok[None, :], other=0.0)
            # A group past K (BK does not divide K) has x zero: its scales, clamped to the last
            # group's, multiply nothing.
            group = tl.minimum(k0 // GROUP + sub, groups - 1)
            if QUANTIZE:  # x's rows in x's dtype: this group quantized here
                a, row_scales = as_operand(a, True, True)
            else:
                row_scales = tl.load(a_scales + group, mask=m_ok, other=0.0)
            block_scale = tl.load(w_scales + group)
            acc += tl.dot(a, tl.trans(w)) * (row_scales * block_scale)[:, None]
    out_mask = m_ok[:, None] & n_ok[None, :]
    out = y_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
    if not SPLIT:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:  # this split's float32 partial, summed in split order
        parts = part_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(parts + tl.program_id(2) * M * N, acc, mask=out_mask)
        if REDUCE:  # by the tile's last split to finish, here (module docstring)
            tl.debug_barrier()  # every thread's partial stored before this split counts in
            tile = count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)
            splits = tl.num_programs(2)
            if tl.atomic_add(tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
                total = tl.zeros((BM, BN), dtype=tl.float32)
                for split in range(splits):  # from L2: other programs wrote them
                    total += tl.load(
                        parts + split * M * N, mask=out_mask, other=0.0, cache_modifier=".cg"
                    )
                if HAS_BIAS:
                    total += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
                tl.store(out, total.to(y_ptr.dtype.element_ty), mask=out_mask)
                tl.atomic_xchg(tile, 0)


class Tiles(NamedTuple):
    """One launch's shape: a BM x BN output tile, K steps of BK (a multiple of 128), K cut into
    `splits` ranges, and the launch's warps and pipeline stages."""

    bm: int
    bn: int
    bk: int
    splits: int
    warps: int
    stages: int


def tiles_for(m: int, n: int, k: int) -> Tiles:
    """The tiles of an [m, k] x [n, k]^T GEMM, from sweeps on an H200 (docs/benchmarks.md):
    64-column tiles, one row tile up to 64 rows and 64-row tiles to 512, K split until about 320
    programs stream the weight at up to 16 rows and 128 past that (a program with more rows has
    more to do per weight byte), at most 8 splits. Past 16 rows deeper pipelines: K steps of 256
    over 4 stages to 64 rows, and 6 stages past that for a K of 4096 and more. Past 512 rows
    (prefill) 128 x 128 tiles over 8 warps, whole K."""
    if m > 512:
        return Tiles(128, 128, GROUP, 1, 8, 3)
    bm = min(64, max(16, triton.next_power_of_2(m)))
    bn = 64
    if m <= 16:
        bk, stages = GROUP, 3
    elif m <= 64:
        bk, stages = 2 * GROUP, 4
    else:
        bk, stages = GROUP, 6 if k >= 4096 else 3
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    target = 320 if m <= 16 else 128
    splits = max(1, min(triton.cdiv(k, bk), MAX_SPLITS // 2, target // tiles))
    return Tiles(bm, bn, bk, splits, 4, stages)


def grouped_supports(x: torch.Tensor, q: torch.Tensor, groups: int) -> bool:
    """A grouped projection whose groups meet on the 128-wide activation groups and on whole
    output tiles (tiles are at most 128 columns wide)."""
    k, n = q.shape[1], q.shape[0]
    return (
        x.shape[-1] == groups * k
        and k % GROUP == 0
        and n % groups == 0
        and (n // groups) % 128 == 0
    )


def quantize_rows(x2: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (rows contiguous) -> (e4m3 [M, K], float32 scales [M, ceil(K / 128)])."""
    m, k = x2.shape
    groups = triton.cdiv(k, GROUP)
    q = torch.empty(m, k, dtype=FP8_DTYPE, device=x2.device)
    scales = torch.empty(m, groups, dtype=torch.float32, device=x2.device)
    if m:
        per = min(QUANTIZE_GROUPS, triton.next_power_of_2(groups))
        _quantize_kernel[(m, triton.cdiv(groups, per))](
            x2,
            q,
            scales,
            k,
            x2.stride(0),
            groups,
            FP8_LIMIT=FP8_MAX,
            GROUP=GROUP,
            GROUPS=per,
            num_warps=max(1, per // 2),
        )
    return q, scales


def fp8_linear(
    x: torch.Tensor | Fp8Rows,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    tiles: Tiles | None = None,
    groups: int = 1,
) -> torch.Tensor:
    """`kernels/fp8.fp8_linear_w8a8` on CUDA: x [..., in] (bf16/fp16, or rows [M, in] already
    quantized by the kernel before) -> [..., out] in x's dtype. Check `triton_fp8.supports`
    first. `tiles` overrides `tiles_for` (the kernel bench sweeps them). `groups` > 1: a grouped
    projection (`grouped_supports`), x [..., groups * in] and q [groups * out_g, in]: output
    group g of x's g-th `in` columns, one launch."""
    quantized = isinstance(x, Fp8Rows)
    lead, k = x.shape[:-1], q.shape[1]
    n = q.shape[0]
    if x.shape[-1] != groups * k or n % groups:
        raise ValueError(
            f"fp8_linear: x {tuple(x.shape)}, weight {tuple(q.shape)}, {groups} groups"
        )
    x2 = x.values if quantized else x.reshape(-1, groups * k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x2.device)
    if m == 0:
        return y.view(*lead, n)
    fused = not quantized and m <= QUANTIZE_IN_GEMM_ROWS
    # Fused: the GEMM reads x itself (`xs` is not read).
    if quantized:
        xq, xs = x2, x.scales
    else:
        xq, xs = (x2, x2) if fused else quantize_rows(x2)
    scale_inv = scale_inv.contiguous()
    bm, bn, bk, splits, warps, stages = tiles or tiles_for(m, n, k)
    if groups > 1 and (n // groups) % bn:
        raise ValueError(f"fp8_linear: {n // groups} outputs a group, not a multiple of {bn}")
    steps_per_split = triton.cdiv(triton.cdiv(k, bk), splits)
    splits = triton.cdiv(triton.cdiv(k, bk), steps_per_split)
    part = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x2.device)
    bias_arg = bias if bias is not None else y  # never read without a bias
    grid = (triton.cdiv(n, bn), triton.cdiv(m, bm), splits)
    reduce = splits > 1 and REDUCE_IN_GEMM and grid[0] * grid[1] <= MAX_SPLIT_TILES
    counters = tile_counters(q, MAX_SPLIT_TILES) if reduce else y  # never read unless reducing
    _gemm_kernel[grid](
        xq,
        xs,
        q,
        scale_inv,
        bias_arg,
        y,
        part,
        counters,
        m,
        n,
        k,
        triton.cdiv(k, GROUP),
        scale_inv.stride(0),
        steps_per_split * bk,
        xq.stride(0),
        xs.stride(0) if not fused else 0,
        n // groups,
        HAS_BIAS=bias is not None,
        BM=bm,
        BN=bn,
        BK=bk,
        SPLIT=splits > 1,
        QUANTIZE=fused,
        GROUP=GROUP,
        REDUCE=reduce,
        num_warps=warps,
        num_stages=stages,
    )
    if splits > 1 and not reduce:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            part,
            bias_arg,
            y,
            m,
            n,
            HAS_BIAS=bias is not None,
            SPLIT=splits,
            BLOCK=SUM_BLOCK,
            num_warps=4,
        )
    return y.view(*lead, n)
