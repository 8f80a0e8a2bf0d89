"""A block-scaled FP8 linear layer on CUDA, weight-only: y = x @ dequant(W)^T + bias in one
Triton GEMM, and the pieces the FP8 kernels share (`as_operand`, `block_dot`, `block_dot_left`).

W [out, in] stays float8_e4m3fn with a float32 `scale_inv` per 128 x 128 block (the format and
reference: kernels/reference/fp8.py); no dequantized copy is written. bf16/fp16 x takes the w8a8
GEMM (fp8_w8a8.py, `w8a8`); this one serves float32 x. The scales, by M:
- small M (decode, up to `SMALL_M` rows; every routed-expert kernel too): a tile's columns and K
  step divide 128 and start on a multiple of their size, so it lies in one scale block; tl.dot
  runs on the FP8 values cast to fp16 (exact, as are bf16 rows scaled into fp16: `as_operand`)
  and its float32 partial is multiplied by the block scale (`block_dot`). The reference's
  rounding of each dequantized weight to x's dtype is the only difference it skips.
- large M (prefill): each tile dequantized in registers as the reference does (`dequant_tile`).
At small M the output alone gives too few programs to keep every SM streaming the weight, so K
is split too, in whole scale blocks; a second launch sums the float32 partials in split order,
adds the bias and rounds once (deterministic). Shapes pick the tiles: no host sync.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.reference.fp8 import FP8_DTYPE, scale_grid

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


def weight_fits(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> bool:
    """A contiguous 2-D FP8 weight on CUDA with its float32 grid of 128 x 128 blocks."""
    return q.is_cuda and grid_fits(q, scale_inv, block)


def grid_fits(q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]) -> bool:
    """`weight_fits` on any device (what `dequantize` reads, the interpreter included)."""
    if not (q.dtype == FP8_DTYPE and q.dim() == 2 and q.is_contiguous()):
        return False
    if scale_inv.dtype != torch.float32:
        return False
    return tuple(block) == (SCALE_BLOCK, SCALE_BLOCK) and tuple(scale_inv.shape) == scale_grid(
        *q.shape, block
    )


def supports(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int]
) -> bool:
    """Float activations on CUDA against such a weight."""
    if not (x.is_cuda and x.shape[-1] == q.shape[-1] and weight_fits(q, scale_inv, block)):
        return False
    return x.dtype in (torch.bfloat16, torch.float16, torch.float32)


@triton.jit
def dequant_tile(w_ptrs, w_mask, s_ptrs, s_mask, DTYPE: tl.constexpr):
    """An FP8 weight tile in DTYPE: values times their block scale in float32, rounded once, as
    kernels/fp8.dequantize_blockwise computes them."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    scale = tl.load(s_ptrs, mask=s_mask, other=0.0)
    return (w.to(tl.float32) * scale).to(DTYPE)


@triton.jit
def exact_shift(amax, limit: tl.constexpr):
    """The least integer s with amax / 2^s <= limit (`kernels/fp8.quantize_activations`' exponent):
    log2 is approximate on the GPU, so its ceiling is checked both ways, exactly (a power of two
    only moves the exponent)."""
    shift = tl.ceil(tl.log2(amax / limit))
    shift = tl.where(amax * tl.exp2(1.0 - shift) <= limit, shift - 1.0, shift)
    return tl.where(amax * tl.exp2(-shift) > limit, shift + 1.0, shift)


@triton.jit
def _pow2(shift):
    """2^shift for int32 shifts in [-126, 127], exactly: its float32 bits."""
    return ((shift + 127) << 23).to(tl.float32, bitcast=True)


@triton.jit
def as_operand(xs, X_SCALED: tl.constexpr, A_FP8: tl.constexpr = False):
    """(left operand, per-row scale) of a dot against FP8 weights.

    A_FP8 (w8a8): each row of the K step quantized to float8_e4m3fn with the power-of-two scale
    that brings its largest value into (224, 448] (DeepSeek's 1 x 128 activation groups, as
    reference/fp8.py's quantize_activations), so the dot runs on FP8 tensor cores as stored.
    X_SCALED (bf16 x, weight-only): each row times the power of two that brings its largest value
    into [2^13, 2^14), in fp16: exact (only values below 2^-27 of the row's largest lose bits),
    and the dot runs in fp16 against FP8 weights cast to fp16, one instruction per two values
    where bf16 takes three (Triton's e4m3 -> bf16 goes through fp16). Otherwise x as it is.
    Both exponents come from the largest value's float32 bits, amax = m 2^e with m in [1, 2), a
    few integer operations rather than a log2 polynomial: A_FP8 divides by 2^(e - 8) if
    m <= 1.75 (448 = 1.75 * 2^8), else by 2^(e - 7); X_SCALED by 2^(e - 13). The clamps keep amax
    normal, so every power of two is a normal float32."""
    if A_FP8:
        xf = xs.to(tl.float32)
        bits = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-30).to(tl.int32, bitcast=True)
        shift = (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(tl.int32)
        xo = (xf * _pow2(-shift)[:, None]).to(tl.float8e4nv)
        rows = _pow2(shift)
    elif X_SCALED:
        xf = xs.to(tl.float32)
        bits = tl.maximum(tl.max(tl.abs(xf), axis=1), 1e-20).to(tl.int32, bitcast=True)
        shift = (bits >> 23) - 140
        xo = (xf * _pow2(-shift)[:, None]).to(tl.float16)
        rows = _pow2(shift)
    else:
        xo = xs
        rows = xs
    return xo, rows


@triton.jit
def block_dot(
    xo,
    rows,
    w_ptrs,
    w_mask,
    scale_ptr,
    acc,
    W_FP8: tl.constexpr,
    X_SCALED: tl.constexpr,
    PRECISION: tl.constexpr,
):
    """acc + x @ W^T over one K step of a weight tile [columns, K step], x given as
    `as_operand` makes it. FP8 (the tile in one scale block, `scale_ptr` its scale): the dot on
    the FP8 values cast to the operand's dtype (exact), its float32 result times the block scale
    (and the rows' scales). A float weight: the plain dot, accumulated in place."""
    w = tl.load(w_ptrs, mask=w_mask, other=0.0)
    if W_FP8:
        part = tl.dot(xo, tl.trans(w.to(xo.dtype)), input_precision=PRECISION)
        if X_SCALED:
            acc = acc + part * (rows * tl.load(scale_ptr))[:, None]
        else:
            acc = acc + part * tl.load(scale_ptr)
    else:
        acc = tl.dot(xo, tl.trans(w), acc, input_precision=PRECISION)
    return acc


@triton.jit
def block_dot_left(xo, rows, w, scale, acc, X_SCALED: tl.constexpr):
    """`block_dot` with the weights as the dot's left operand: acc [columns, rows] + W x^T over
    one K step of an FP8 weight tile `w` [columns, K step] (loaded), x given as `as_operand`
    makes it. `scale`: the tile's block scale, a scalar or [columns, 1] (a tile of two blocks'
    rows: gate's and up's). The FP8 values cast to the operand's dtype (exact; none for w8a8),
    the float32 product times the block scale, then by the rows' power-of-two scales (exact:
    the same float32 values as `block_dot`'s)."""
    part = tl.dot(w.to(xo.dtype), tl.trans(xo))
    if X_SCALED:
        acc = acc + (part * scale) * rows[None, :]
    else:
        acc = acc + part * scale
    return acc


@triton.jit
def gate_up_right(
    x_rows,
    row_ok,
    gate_rows,
    up_rows,
    col_ok,
    gate_scales,
    up_scales,
    hidden,
    k,
    W_FP8: tl.constexpr,
    X_SCALED: tl.constexpr,
    A_FP8: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    """(gate, up) [ROWS, COLUMNS] float32 of an expert kernel's tile with the weights as the dots'
    right operand (x W^T): x's rows (`x_rows`, masked by `row_ok`) against the gate and up rows of
    its columns, K step by K step, x made an operand once per step for both (`as_operand`)."""
    gate = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
    up = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
    for k0 in range(0, hidden, K_BLOCK):
        xs = tl.load(x_rows + k0 + k[None, :], mask=row_ok[:, None], other=0.0)
        xo, rs = as_operand(xs, X_SCALED, A_FP8)
        w_cols = k0 + k[None, :]
        gate = block_dot(
            xo,
            rs,
            gate_rows + w_cols,
            col_ok[:, None],
            gate_scales + k0 // 128,
            gate,
            W_FP8,
            X_SCALED,
            "tf32",
        )
        up = block_dot(
            xo,
            rs,
            up_rows + w_cols,
            col_ok[:, None],
            up_scales + k0 // 128,
            up,
            W_FP8,
            X_SCALED,
            "tf32",
        )
    return gate, up


@triton.jit
def down_tile(
    h_rows,
    row_ok,
    down_rows,
    col_ok,
    scales,
    inter,
    k,
    W_FP8: tl.constexpr,
    X_SCALED: tl.constexpr,
    A_FP8: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
):
    """acc [ROWS, COLUMNS] float32 of an expert kernel's down tile: h's rows against the down
    rows of its columns. WEIGHTS_LEFT (FP8 only): `down_rows` [COLUMNS, K step] pointers whose
    columns past the last read the last one's weights, h's rows unmasked (rows past the tile's
    pairs read pair 0's, never stored), the weights the dots' left operand; otherwise
    `down_rows` [COLUMNS, 1] row starts, h masked, the weights right."""
    if WEIGHTS_LEFT:
        acc = tl.zeros((COLUMNS, ROWS), dtype=tl.float32)
        for k0 in range(0, inter, K_BLOCK):
            ho, rs = as_operand(tl.load(h_rows + k0 + k[None, :]), X_SCALED, A_FP8)
            acc = block_dot_left(
                ho, rs, tl.load(down_rows + k0), tl.load(scales + k0 // 128), acc, X_SCALED
            )
        acc = tl.trans(acc)
    else:
        acc = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        for k0 in range(0, inter, K_BLOCK):
            hs = tl.load(h_rows + k0 + k[None, :], mask=row_ok[:, None], other=0.0)
            ho, rs = as_operand(hs, X_SCALED, A_FP8)
            acc = block_dot(
                ho,
                rs,
                down_rows + k0 + k[None, :],
                col_ok[:, None],
                scales + k0 // 128,
                acc,
                W_FP8,
                X_SCALED,
                "tf32",
            )
    return acc


@triton.jit
def _fp8_linear_kernel(
    x_ptr,
    w_ptr,
    s_ptr,
    b_ptr,
    y_ptr,
    part_ptr,
    M,
    N,
    K,
    x_stride,
    s_stride,
    k_per_split,
    HAS_BIAS: tl.constexpr,
    BM: tl.constexpr,
    BN: tl.constexpr,
    BK: tl.constexpr,
    PRECISION: tl.constexpr,
    SCALE_PARTIALS: tl.constexpr,
    SPLIT: tl.constexpr,
    X_SCALED: tl.constexpr,
):
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
            xo, rows = as_operand(xs, X_SCALED)
            acc = block_dot(
                xo, rows, w_rows + kk[None, :], w_mask, scale, acc, True, X_SCALED, PRECISION
            )
        else:  # dequantized as the reference does, accumulated in place
            w = dequant_tile(w_rows + kk[None, :], w_mask, s_rows + k0 // 128, n_ok[:, None], dtype)
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
def _sum_splits_kernel(
    part_ptr, b_ptr, y_ptr, M, N, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK: tl.constexpr
):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < M * N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for split in range(SPLIT):
        acc += tl.load(part_ptr + split * M * N + i, mask=ok, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + i % N, mask=ok, other=0.0).to(tl.float32)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def _tiles(m: int, n: int, k: int) -> tuple[int, int, int, int, int, int]:
    """(BM, BN, BK, splits of K, warps, stages) by shape. Small M: output tiles as wide as they
    are tall, at least 32 (every program reads its x rows from L2 once per K step, twice its
    FP8 weight tile's bytes at most: L2 serves them faster than HBM the weight), and K split so
    that TARGET_PROGRAMS programs stream the weight (a GEMV's output alone gives too few
    programs). Large M: square tiles, whole K (compute-bound: reuse each loaded weight tile over
    many rows)."""
    if m > SMALL_M:
        return 128, 128, 64, 1, 8, 3
    bm = max(16, triton.next_power_of_2(m))
    bn = max(32, bm)
    tiles = triton.cdiv(n, bn) * triton.cdiv(m, bm)
    k_blocks = triton.cdiv(k, SCALE_BLOCK)
    # The partials' bytes (4 * splits * M * N, written and read) at most a quarter of the
    # weight's (N * K): at M = 64 they would otherwise rival it.
    most = max(1, k // (16 * m))
    splits = max(1, min(k_blocks, TARGET_PROGRAMS // tiles, MAX_SPLITS, most))
    return bm, bn, SCALE_BLOCK, splits, 4, 4


# Whether the dense GEMM quantizes its activations (w8a8, kernels/triton/fp8_w8a8.py): faster
# than weight-only on an H200 (docs/benchmarks.md, "Kernel constants"); vLLM and DeepSeek's own
# inference quantize activations the same way (per token, groups of 128).
W8A8 = True
# Whether the routed-expert kernels (moe/fp8_decode.py, moe/grouped.py) quantize x and h too:
# faster on an H200 (docs/benchmarks.md, "Kernel constants").
W8A8_EXPERTS = True


def w8a8(dtype: torch.dtype) -> bool:
    """Whether the dense GEMM quantizes x of `dtype`: 16-bit x only (a float32 model asked for
    the weight-only precision)."""
    return W8A8 and dtype in (torch.bfloat16, torch.float16)


def operand_modes(a8: bool, k_block: int, dtype: torch.dtype, w_fp8: bool = True) -> dict:
    """`as_operand`'s constexprs for a kernel stepping K by `k_block` against FP8 weights (w_fp8)
    or weights in x's dtype: w8a8 only where asked and the step is at least 32 (the smallest K
    of an FP8 dot; a reduction dim of 16 or 48 steps by 16), else fp16-scaled bf16 rows."""
    a8 = w_fp8 and a8 and k_block >= 32
    return dict(X_SCALED=a8 or (w_fp8 and dtype == torch.bfloat16), A_FP8=a8)


def fp8_linear(
    x: torch.Tensor, q: torch.Tensor, scale_inv: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    """`kernels/fp8.fp8_linear` on CUDA, weight-only: x [..., in] -> [..., out] in x's dtype."""
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
        x2,
        q,
        scale_inv,
        bias_arg,
        y,
        part,
        m,
        n,
        k,
        x2.stride(0),
        scale_inv.stride(0),
        blocks_per_split * SCALE_BLOCK,
        HAS_BIAS=bias is not None,
        BM=bm,
        BN=bn,
        BK=bk,
        PRECISION=precision,
        SCALE_PARTIALS=m <= SMALL_M,
        SPLIT=splits,
        X_SCALED=x.dtype == torch.bfloat16,
        num_warps=warps,
        num_stages=stages,
    )
    if splits > 1:
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


@triton.jit
def _dequantize_kernel(
    q_ptr, s_ptr, out_ptr, rows, cols, s_stride, ROWS: tl.constexpr, COLS: tl.constexpr
):
    # ROWS divides 128 and COLS is 128: the tile lies in one scale block.
    r = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    c = tl.program_id(1) * COLS + tl.arange(0, COLS)
    ok = (r < rows)[:, None] & (c < cols)[None, :]
    offsets = r.to(tl.int64)[:, None] * cols + c[None, :]
    scale = tl.load(s_ptr + (tl.program_id(0) * ROWS // 128) * s_stride + tl.program_id(1))
    q = tl.load(q_ptr + offsets, mask=ok, other=0.0)
    tl.store(out_ptr + offsets, (q.to(tl.float32) * scale).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """`kernels/fp8.dequantize_blockwise` of a 2-D weight on CUDA, value for value (float32
    product, rounded once), in one pass: one byte read and one element written per weight,
    where the reference expands the scale grid to a float32 matrix first. For the weights used
    as matrices (MLA's absorbed kv_b_proj); check `weight_fits` first."""
    rows, cols = q.shape
    out = torch.empty(rows, cols, dtype=dtype, device=q.device)
    scale_inv = scale_inv.contiguous()
    tile_rows = 32
    grid = (triton.cdiv(rows, tile_rows), triton.cdiv(cols, SCALE_BLOCK))
    _dequantize_kernel[grid](
        q,
        scale_inv,
        out,
        rows,
        cols,
        scale_inv.stride(0),
        ROWS=tile_rows,
        COLS=SCALE_BLOCK,
        num_warps=4,
    )
    return out
