"""A block-scaled FP8 linear layer on CUDA: y = x @ dequant(W)^T + bias in one Triton GEMM.

W [out, in] stays float8_e4m3fn in GPU memory with a float32 `scale_inv` per 128 x 128 block
(kernels/fp8.py has the format and the reference). Weight-only: x and y stay in x's dtype, the
bytes read are one per weight plus the scales, and no dequantized copy of the weight is written.
Two ways to apply the scales, by M:

- small M (decode, up to 64 rows; also every routed-expert kernel): a tile's output columns and
  its K step both divide 128 and start on a multiple of their size, so the whole tile lies in one
  scale block. The FP8 values are cast to x's dtype (exact: every e4m3 value is a bf16 / fp16
  value), tl.dot runs on them, and its float32 partial is multiplied by the one block scale
  (`block_dot`). Per weight element that is one conversion: these GEMMs are memory-bound, and
  converting each element to float32, scaling and rounding it back would cost ALU time close to
  the time its byte takes to arrive. Against the reference (which rounds each dequantized weight
  to x's dtype) the only difference is that rounding, which this skips.
- large M (prefill): each tile is dequantized in registers as the reference does it (FP8 to
  float32, times its row's block scale, rounded to x's dtype: `dequant_tile`) and accumulated in
  place; the conversion is shared by BM rows, and the in-place accumulator keeps the MMA pipeline.

At small M the output alone gives too few programs to keep every SM streaming the weight (a
2048-wide projection in tiles of 32 columns is 64 programs), so K is split too, in whole scale
blocks; each split writes a float32 partial and a second launch sums them in split order, adds
the bias and rounds once (deterministic, unlike atomics).

No w8a8 path (activations quantized per token on the fly, tl.dot on FP8 inputs): it would only
pay for compute-bound prefill GEMMs, and decode is memory-bound. No host sync: shapes pick the
tiles, so a CUDA graph captures the launches at their batch size.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.fp8 import FP8_DTYPE

SCALE_BLOCK = 128  # the one block size read (model/quantization.BLOCK)
# Programs to aim for at small M, so that a memory-bound GEMV keeps every SM streaming weights:
# twice the SM count of an H100/H200.
TARGET_PROGRAMS = 264
# Rows up to which a GEMM is taken as memory-bound: narrow tiles, scales applied to partials,
# K split over programs.
SMALL_M = 64
# At most this many K splits: their float32 partials ([splits, M, N], L2-resident at these sizes)
# are summed in split order by a second launch, so the result does not depend on timing.
MAX_SPLITS = 16
SUM_BLOCK = 1024


def supports(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> bool:
    """Float activations on CUDA, a 2-D FP8 weight of the 128 x 128 layout."""
    if not (x.is_cuda and q.dtype == FP8_DTYPE and q.dim() == 2 and q.is_contiguous()):
        return False
    if tuple(block) != (SCALE_BLOCK, SCALE_BLOCK) or x.shape[-1] != q.shape[1]:
        return False
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def dequant_tile(w_ptrs, w_mask, s_ptrs, s_mask, DTYPE: tl.constexpr, W_FP8: tl.constexpr):
    """A weight tile in DTYPE: FP8 values times their block scale (float32, rounded once), as
    kernels/fp8.dequantize_blockwise computes them; a float weight is loaded as is."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if W_FP8:
        scale = tl.load(s_ptrs, mask=s_mask, other=0.0)
        w = w.to(tl.float32) * scale
    return w.to(DTYPE)


@triton.jit
def block_dot(xs, w_ptrs, w_mask, scale_ptr, acc, W_FP8: tl.constexpr, PRECISION: tl.constexpr):
    """acc + xs @ W^T over one K step of a weight tile [columns, K step]. FP8 (the tile in one
    scale block, `scale_ptr` its scale): the dot on the FP8 values cast to xs's dtype, its float32
    result times the scale. A float weight: the plain dot, accumulated in place."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if W_FP8:
        part = tl.dot(xs, tl.trans(w.to(xs.dtype)), input_precision=PRECISION)
        acc = acc + part * tl.load(scale_ptr)
    else:
        acc = tl.dot(xs, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def _fp8_linear_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, y_ptr, part_ptr, M, N, K, x_stride, s_stride, k_per_split,
    HAS_BIAS: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr,
    PRECISION: tl.constexpr, SCALE_PARTIALS: tl.constexpr, SPLIT: tl.constexpr,
):  # fmt: skip
    m = tl.program_id(1) * BM + tl.arange(0, BM)
    n = tl.program_id(0) * BN + tl.arange(0, BN)
    k = tl.arange(0, BK)
    m_ok, n_ok = m < M, n < N
    x_rows = x_ptr + m.to(tl.int64)[:, None] * x_stride
    w_rows = w_ptr + n.to(tl.int64)[:, None] * K
    s_rows = s_ptr + (n // 128)[:, None] * s_stride  # [BN, 1]
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros((BM, BN), dtype=tl.float32)
    k_first = tl.program_id(2) * k_per_split  # a multiple of 128
    for k0 in range(k_first, tl.minimum(K, k_first + k_per_split), BK):
        kk = k0 + k
        k_ok = kk < K
        xs = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
        w_mask = n_ok[:, None] & k_ok[None, :]
        if SCALE_PARTIALS:  # BN and BK divide 128: one scale for the tile
            scale = s_ptr + (tl.program_id(0) * BN // 128) * s_stride + k0 // 128
            acc = block_dot(xs, w_rows + kk[None, :], w_mask, scale, acc, True, PRECISION)
        else:  # dequantized as the reference does, accumulated in place
            w = dequant_tile(w_rows + kk[None, :], w_mask, s_rows + k0 // 128, n_ok[:, None],
                             dtype, True)  # fmt: skip
            acc = tl.dot(xs, tl.trans(w), acc, input_precision=PRECISION)
    out_mask = m_ok[:, None] & n_ok[None, :]
    if SPLIT == 1:
        if HAS_BIAS:
            acc += tl.load(b_ptr + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        out = y_ptr + m.to(tl.int64)[:, None] * N + n[None, :]
        tl.store(out, acc.to(y_ptr.dtype.element_ty), mask=out_mask)
    else:  # this split's float32 partial, summed in split order by _sum_splits_kernel
        part = part_ptr + (tl.program_id(2) * M + m.to(tl.int64))[:, None] * N + n[None, :]
        tl.store(part, acc, mask=out_mask)


@triton.jit
def _sum_splits_kernel(part_ptr, b_ptr, y_ptr, M, N, HAS_BIAS: tl.constexpr,
                       SPLIT: tl.constexpr, BLOCK: tl.constexpr):  # fmt: skip
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLIT):
        acc += tl.load(part_ptr + split * M * N + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, BK, splits of K, warps, stages) by shape. Small M: the output tile at least twice
    as wide as it is tall (every program reads its x rows from L2 once per K step: they should
    not outweigh its weight tile), and K split so that TARGET_PROGRAMS programs stream the
    weight (a GEMV's output alone gives too few programs). Large M: square tiles, whole K
    (compute-bound: reuse each loaded weight tile over many rows)."""
    if m > SMALL_M:
        return 128, 128, 64, 1, 8, 3
    bm = max(16, triton.next_power_of_2(m))
    bn = min(128, 2 * bm)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    k_blocks = triton.cdiv(k, SCALE_BLOCK)
    # The partials' bytes (4 * splits * M * N, written and read) at most a quarter of the
    # weight's (N * K): at M = 64 they would otherwise rival it.
    most = max(1, k // (16 * m))
    splits = max(1, min(k_blocks, TARGET_PROGRAMS // tiles, MAX_SPLITS, most))
    return bm, bn, SCALE_BLOCK, splits, 4, 4


def fp8_linear(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`kernels/fp8.fp8_linear` on CUDA: x [..., in] -> [..., out] in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    n = q.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0:
        return y.view(*lead, n)
    scale_inv = scale_inv.contiguous()
    bm, bn, bk, splits, warps, stages = _tiles(m, n, k)
    # Whole 128-column scale blocks per split, at least one each.
    blocks_per_split = triton.cdiv(triton.cdiv(k, SCALE_BLOCK), splits)
    splits = triton.cdiv(triton.cdiv(k, SCALE_BLOCK), blocks_per_split)
    part = y if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32, device=x.device)
    precision = "ieee" if x.dtype == torch.float32 else "tf32"
    bias_arg = bias if bias is not None else y  # never read without a bias
    _fp8_linear_kernel[(triton.cdiv(n, bn), triton.cdiv(m, bm), splits)](
        x2, q, scale_inv, bias_arg, y, part, m, n, k, x2.stride(0), scale_inv.stride(0),
        blocks_per_split * SCALE_BLOCK, HAS_BIAS=bias is not None, BM=bm, BN=bn, BK=bk,
        PRECISION=precision, SCALE_PARTIALS=m <= SMALL_M, SPLIT=splits, num_warps=warps,
        num_stages=stages,
    )  # fmt: skip
    if splits > 1:
        _sum_splits_kernel[(triton.cdiv(m * n, SUM_BLOCK),)](
            part, bias_arg, y, m, n, HAS_BIAS=bias is not None, SPLIT=splits, BLOCK=SUM_BLOCK,
            num_warps=4,
        )  # fmt: skip
    return y.view(*lead, n)
