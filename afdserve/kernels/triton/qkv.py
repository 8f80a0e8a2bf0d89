"""The GQA attention prologue in one Triton launch: RMSNorm of q and k, per head (Qwen3) or over
each row's whole q and k (MiniMax-M2), rotary on both (on each head's first rotary_width channels:
MiniMax-M2's partial rope passes the rest through), and the k/v writes into the paged cache.
Eagerly that is six launches per layer, each a few microseconds of mostly launch overhead at
decode batch sizes.

Grid (row tiles, heads + kv_heads): program (t, h) reads head h of tile t's rows from the fused
qkv rows (for a norm over the heads also each row's whole q or k, whose statistics each program
recomputes from cache rather than in a launch of their own). A tile is one row at decode sizes
and `PREFILL_ROWS` rows in a launch of `PREFILL_FROM` rows or more. q and k heads sit back to
back there, so head h's source is columns [h * dim, (h + 1) * dim) either way. A q program writes
the new q; a k program writes its rotated k and copies the matching v head into the cache, at each
row's slot (slot -1: nothing).

Numerics follow the reference composition step by step, rounding where it rounds: the normalised
head to qkv's dtype, the weight product to the promoted dtype, cos/sin to that dtype, and each
rotary product and sum to it. Float fusion is off so the fp32 path rounds as eager torch does.
An FP8 cache (float8_e4m3fn) gets k and v as `reference.quantize_kv` makes them: the rounded value
in float32 divided by the scale (correctly rounded), clamped to +-448, cast.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.metadata import QKVLayout
from afdserve.kernels.triton.attention import quantize_fp8

_TL_DTYPES = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _round(x, DT: tl.constexpr):
    """x rounded to DT, kept in float32 for the next step (a no-op when DT is float32)."""
    return x.to(DT).to(tl.float32)


@triton.jit
def _normed(x, W, w_idx, mask, inv, NORM: tl.constexpr, DT: tl.constexpr):
    """x normalised by `inv` times its weight, in float32 (reference.rms_norm: the normalised
    value rounded to x's dtype, then one rounding of weight * it); x as it is without a norm."""
    if NORM:
        w = tl.load(W + w_idx, mask=mask, other=0.0).to(tl.float32)
        return _round(w * _round(x.to(tl.float32) * inv, x.dtype), DT)
    return x.to(tl.float32)


@triton.jit
def _norm_rotate(
    src,
    W,
    w_base,
    c,
    s,
    i,
    mask,
    j,
    pass_mask,
    row_src,
    n,
    n_mask,
    eps,
    ROT_HALF: tl.constexpr,
    PASS: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    NORM: tl.constexpr,
    OVER_HEADS: tl.constexpr,
    NORM_WIDTH: tl.constexpr,
    DT: tl.constexpr,
):
    """One head of a tile of rows ([ROWS, channels] indices, `src` and `row_src` [ROWS, 1]):
    (first, second) rotated halves and the pass-through channels past the rotary width, in
    float32, each already rounded to DT. The norm's statistics are each row's head's own, or
    with OVER_HEADS the row's whole q (or k) at `row_src` (indices n, n_mask)."""
    if INTERLEAVE:
        idx1 = 2 * i
        idx2 = 2 * i + 1
    else:
        idx1 = i
        idx2 = ROT_HALF + i
    x1 = tl.load(src + idx1, mask=mask, other=0.0)
    x2 = tl.load(src + idx2, mask=mask, other=0.0)
    xp = tl.load(src + 2 * ROT_HALF + j, mask=pass_mask, other=0.0)
    inv = 1.0
    if NORM:
        if OVER_HEADS:
            a = tl.load(row_src + n, mask=n_mask, other=0.0).to(tl.float32)
            sum_sq = tl.sum(a * a, axis=1, keep_dims=True)
        else:
            a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
            sum_sq = tl.sum(a1 * a1, axis=1, keep_dims=True) + tl.sum(
                a2 * a2, axis=1, keep_dims=True
            )
            if PASS > 0:
                ap = xp.to(tl.float32)
                sum_sq = sum_sq + tl.sum(ap * ap, axis=1, keep_dims=True)
        # Times 1/width rather than over width: torch's CUDA mean does the same, and the product
        # is correctly rounded where Triton's float division (div.full.f32) is approximate.
        inv_width: tl.constexpr = 1.0 / NORM_WIDTH
        inv = tl.math.rsqrt(sum_sq * inv_width + eps)
    y1 = _normed(x1, W, w_base + idx1, mask, inv, NORM, DT)
    y2 = _normed(x2, W, w_base + idx2, mask, inv, NORM, DT)
    yp = _normed(xp, W, w_base + 2 * ROT_HALF + j, pass_mask, inv, NORM, DT)
    # reference.rotate: every product and sum rounded to the rotated tensor's dtype.
    o1 = _round(_round(y1 * c, DT) - _round(y2 * s, DT), DT)
    o2 = _round(_round(y2 * c, DT) + _round(y1 * s, DT), DT)
    return o1, o2, yp


@triton.jit
def _store_k(K_CACHE, offset, o, idx, keep, k_scale, FP8_KV: tl.constexpr):
    if FP8_KV:
        tl.store(K_CACHE + offset + idx, quantize_fp8(o, k_scale, K_CACHE.dtype.element_ty), keep)
    else:
        tl.store(K_CACHE + offset + idx, o.to(K_CACHE.dtype.element_ty), mask=keep)


@triton.jit
def _qkv_kernel(
    X,
    QW,
    KW,
    COS,
    SIN,
    SLOT,
    Q,
    K_CACHE,
    V_CACHE,
    stride_x,
    stride_cos,
    stride_sin,
    stride_slot,
    n_rows,
    eps,
    k_scale,
    v_scale,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    DIM: tl.constexpr,
    DIM_PAD: tl.constexpr,
    ROT_HALF: tl.constexpr,
    ROT_PAD: tl.constexpr,
    PASS_PAD: tl.constexpr,
    Q_NORM_PAD: tl.constexpr,
    K_NORM_PAD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    NORM: tl.constexpr,
    OVER_HEADS: tl.constexpr,
    DT: tl.constexpr,
    FP8_KV: tl.constexpr,
    ROWS: tl.constexpr,
):
    # A tile of ROWS rows of one head: one row a program at decode sizes, several in prefill,
    # where a program of one row's head is too small to keep the loads in flight.
    rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    row_ok = (rows < n_rows)[:, None]
    row = rows.to(tl.int64)[:, None]  # [ROWS, 1]
    head = tl.program_id(1)
    PASS: tl.constexpr = DIM - 2 * ROT_HALF
    i = tl.arange(0, ROT_PAD)[None, :]
    mask = (i < ROT_HALF) & row_ok
    j = tl.arange(0, PASS_PAD)[None, :]
    pass_mask = (j < PASS) & row_ok
    x_row = X + row * stride_x
    src = x_row + head * DIM
    c = _round(tl.load(COS + row * stride_cos + i, mask=mask, other=0.0).to(tl.float32), DT)
    s = _round(tl.load(SIN + row * stride_sin + i, mask=mask, other=0.0).to(tl.float32), DT)
    # Names assigned in both branches of this runtime `if` must keep one type: q's and k's
    # columns (different widths) get names of their own.
    if head < HEADS:
        q_cols = tl.arange(0, Q_NORM_PAD)[None, :]
        o1, o2, op = _norm_rotate(
            src,
            QW,
            head * DIM if OVER_HEADS else 0,
            c,
            s,
            i,
            mask,
            j,
            pass_mask,
            x_row,
            q_cols,
            (q_cols < HEADS * DIM) & row_ok,
            eps,
            ROT_HALF,
            PASS,
            INTERLEAVE,
            NORM,
            OVER_HEADS,
            HEADS * DIM if OVER_HEADS else DIM,
            DT,
        )
        dst = Q + (row * HEADS + head) * DIM
        tl.store(dst + i, o1.to(Q.dtype.element_ty), mask=mask)
        tl.store(dst + ROT_HALF + i, o2.to(Q.dtype.element_ty), mask=mask)
        tl.store(dst + 2 * ROT_HALF + j, op.to(Q.dtype.element_ty), mask=pass_mask)
    else:
        kv = head - HEADS
        k_cols = tl.arange(0, K_NORM_PAD)[None, :]
        o1, o2, op = _norm_rotate(
            src,
            KW,
            kv * DIM if OVER_HEADS else 0,
            c,
            s,
            i,
            mask,
            j,
            pass_mask,
            x_row + HEADS * DIM,
            k_cols,
            (k_cols < KV_HEADS * DIM) & row_ok,
            eps,
            ROT_HALF,
            PASS,
            INTERLEAVE,
            NORM,
            OVER_HEADS,
            KV_HEADS * DIM if OVER_HEADS else DIM,
            DT,
        )
        slot = tl.load(SLOT + row * stride_slot, mask=row_ok, other=-1).to(tl.int64)
        offset = (slot * KV_HEADS + kv) * DIM  # masked off entirely when slot is -1
        # Quantized by _store_k: o1/o2 must keep the q branch's float32 type.
        _store_k(K_CACHE, offset, o1, i, mask & (slot >= 0), k_scale, FP8_KV)
        _store_k(K_CACHE, offset, o2, ROT_HALF + i, mask & (slot >= 0), k_scale, FP8_KV)
        _store_k(K_CACHE, offset, op, 2 * ROT_HALF + j, pass_mask & (slot >= 0), k_scale, FP8_KV)
        d = tl.arange(0, DIM_PAD)[None, :]
        keep = (d < DIM) & (slot >= 0)
        v = tl.load(src + KV_HEADS * DIM + d, mask=keep, other=0.0)  # v head kv: kv_heads later
        if FP8_KV:
            v = quantize_fp8(v, v_scale, V_CACHE.dtype.element_ty)
        tl.store(V_CACHE + offset + d, v.to(V_CACHE.dtype.element_ty), mask=keep)


# Rows a program takes in a launch of PREFILL_FROM rows or more (not with a norm over the heads,
# whose statistics tile is already a whole row): one row's head, 128 channels over one warp, is too
# little work to keep the loads in flight when a prefill step launches 8192 x 40 of them. 8 rows
# against 4 and 16: docs/benchmarks.md (tools/profile_prefill.py --set ...PREFILL_ROWS=N).
PREFILL_ROWS = 8
PREFILL_FROM = 1024


def launch_tile(rows: int, rot_pad: int, over_heads: bool) -> tuple[int, int]:
    """(rows a program, warps) of a launch over `rows` rows whose rotary halves pad to
    `rot_pad` channels (the compile test builds the kernel at these too)."""
    if over_heads:
        return 1, 4
    tile = PREFILL_ROWS if rows >= PREFILL_FROM else 1
    return tile, max(1, min(4, tile * rot_pad // 64))


# The widest q (heads * head_dim) whose norm statistics a program reads in one tile.
MAX_NORM_WIDTH = 16384


def supports(
    qkv: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    head_dim: int,
    layout: QKVLayout | None = None,
) -> bool:
    if layout is not None and layout.norm_over_heads and layout.heads * head_dim > MAX_NORM_WIDTH:
        return False
    return (
        qkv.is_cuda
        and k_cache.is_cuda
        and v_cache.is_cuda
        and qkv.dtype in _TL_DTYPES
        and k_cache.dtype == v_cache.dtype
        and k_cache.dtype in (qkv.dtype, torch.float8_e4m3fn)
        and qkv.stride(-1) == 1
        and k_cache.is_contiguous()
        and v_cache.is_contiguous()
        and head_dim % 2 == 0
        and 0 < head_dim <= 512
    )


def prepare_qkv(
    qkv: torch.Tensor,
    layout: QKVLayout,
    cos: torch.Tensor,
    sin: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> torch.Tensor:
    """qkv [rows, (heads + 2 * kv_heads) * head_dim] (last dim contiguous, rows may be strided);
    q_norm/k_norm [head_dim] (or [heads * head_dim] / [kv_heads * head_dim] with
    layout.norm_over_heads) or both None; cos/sin [rows, rotary_width / 2] float32 (last dim
    contiguous); caches [blocks, block_size, kv_heads, head_dim] contiguous; slot_mapping [rows],
    -1 for pad rows; caches in qkv's dtype, or float8_e4m3fn quantized with k_scale / v_scale.
    Writes k and v into the caches; returns q [rows, heads, head_dim] in qkv's
    dtype. Call `supports` first on CUDA."""
    heads, kv_heads, head_dim = layout.heads, layout.kv_heads, layout.head_dim
    q_norm, k_norm = layout.q_norm, layout.k_norm
    rows = qkv.shape[0]
    q = torch.empty(rows, heads, head_dim, dtype=qkv.dtype, device=qkv.device)
    if rows == 0:
        return q
    norm = q_norm is not None
    over_heads = norm and layout.norm_over_heads
    # The reference's norm output takes torch's promotion of weight and input; rotary then
    # rounds in that dtype. q comes back in qkv's dtype regardless.
    dtype = torch.promote_types(q_norm.dtype, qkv.dtype) if norm else qkv.dtype
    rot_half = layout.rotary_width // 2
    rot_pad = triton.next_power_of_2(rot_half)
    tile, warps = launch_tile(rows, rot_pad, over_heads)
    _qkv_kernel[(triton.cdiv(rows, tile), heads + kv_heads)](
        qkv,
        q_norm if norm else qkv,  # unread when NORM is off
        k_norm if norm else qkv,
        cos,
        sin,
        slot_mapping,
        q,
        k_cache,
        v_cache,
        qkv.stride(0),
        cos.stride(0),
        sin.stride(0),
        slot_mapping.stride(0),
        rows,
        layout.eps,
        float(k_scale),
        float(v_scale),
        HEADS=heads,
        KV_HEADS=kv_heads,
        DIM=head_dim,
        DIM_PAD=triton.next_power_of_2(head_dim),
        ROT_HALF=rot_half,
        ROT_PAD=rot_pad,
        PASS_PAD=triton.next_power_of_2(max(1, head_dim - 2 * rot_half)),
        Q_NORM_PAD=triton.next_power_of_2(heads * head_dim) if over_heads else 1,
        K_NORM_PAD=triton.next_power_of_2(kv_heads * head_dim) if over_heads else 1,
        INTERLEAVE=layout.interleave,
        NORM=norm,
        OVER_HEADS=over_heads,
        DT=_TL_DTYPES[dtype],
        FP8_KV=k_cache.dtype == torch.float8_e4m3fn,
        ROWS=tile,
        num_warps=warps,
        enable_fp_fusion=False,
    )
    return q
