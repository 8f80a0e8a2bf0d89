"""The GQA attention prologue in one Triton launch: per-head RMSNorm of q and k (Qwen3), rotary on
both, and the k/v writes into the paged cache. Eagerly that is six launches per layer, each a few
microseconds of mostly launch overhead at decode batch sizes.

Grid (rows, heads + kv_heads): program (r, h) reads head h of row r from the fused qkv row. q and
k heads sit back to back there, so head h's source is columns [h * dim, (h + 1) * dim) either way.
A q program writes the new q; a k program writes its rotated k and copies the matching v head into
the cache, at the row's slot (slot -1: nothing).

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
def _norm_rotate(
    src,
    W,
    c,
    s,
    i,
    mask,
    eps,
    HALF: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    NORM: tl.constexpr,
    DT: tl.constexpr,
):
    """One head: (first, second) output halves in float32, each already rounded to DT."""
    if INTERLEAVE:
        idx1 = 2 * i
        idx2 = 2 * i + 1
    else:
        idx1 = i
        idx2 = HALF + i
    x1 = tl.load(src + idx1, mask=mask, other=0.0)
    x2 = tl.load(src + idx2, mask=mask, other=0.0)
    if NORM:
        a1, a2 = x1.to(tl.float32), x2.to(tl.float32)
        # Times 1/dim rather than over dim: torch's CUDA mean does the same, and the product is
        # correctly rounded where Triton's float division (div.full.f32) is approximate.
        inv_dim: tl.constexpr = 1.0 / (2 * HALF)
        mean_sq = (tl.sum(a1 * a1, axis=0) + tl.sum(a2 * a2, axis=0)) * inv_dim
        inv = tl.math.rsqrt(mean_sq + eps)
        w1 = tl.load(W + idx1, mask=mask, other=0.0).to(tl.float32)
        w2 = tl.load(W + idx2, mask=mask, other=0.0).to(tl.float32)
        # reference.rms_norm: normalised row in x's dtype, then one rounding of weight * it.
        y1 = _round(w1 * _round(a1 * inv, x1.dtype), DT)
        y2 = _round(w2 * _round(a2 * inv, x2.dtype), DT)
    else:
        y1, y2 = x1.to(tl.float32), x2.to(tl.float32)
    # reference.rotate: every product and sum rounded to the rotated tensor's dtype.
    o1 = _round(_round(y1 * c, DT) - _round(y2 * s, DT), DT)
    o2 = _round(_round(y2 * c, DT) + _round(y1 * s, DT), DT)
    return o1, o2


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
    eps,
    k_scale,
    v_scale,
    HEADS: tl.constexpr,
    KV_HEADS: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
    NORM: tl.constexpr,
    DT: tl.constexpr,
    FP8_KV: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    dim: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    src = X + row * stride_x + head * dim
    c = _round(tl.load(COS + row * stride_cos + i, mask=mask, other=0.0).to(tl.float32), DT)
    s = _round(tl.load(SIN + row * stride_sin + i, mask=mask, other=0.0).to(tl.float32), DT)
    if head < HEADS:
        o1, o2 = _norm_rotate(src, QW, c, s, i, mask, eps, HALF, INTERLEAVE, NORM, DT)
        dst = Q + (row * HEADS + head) * dim
        tl.store(dst + i, o1.to(Q.dtype.element_ty), mask=mask)
        tl.store(dst + HALF + i, o2.to(Q.dtype.element_ty), mask=mask)
    else:
        o1, o2 = _norm_rotate(src, KW, c, s, i, mask, eps, HALF, INTERLEAVE, NORM, DT)
        slot = tl.load(SLOT + row * stride_slot).to(tl.int64)
        keep = mask & (slot >= 0)
        kv = head - HEADS
        offset = (slot * KV_HEADS + kv) * dim  # masked off entirely when slot is -1
        if FP8_KV:  # quantized into new names: o1/o2 must keep the q branch's float32 type
            k1 = quantize_fp8(o1, k_scale, K_CACHE.dtype.element_ty)
            k2 = quantize_fp8(o2, k_scale, K_CACHE.dtype.element_ty)
            tl.store(K_CACHE + offset + i, k1, mask=keep)
            tl.store(K_CACHE + offset + HALF + i, k2, mask=keep)
        else:
            tl.store(K_CACHE + offset + i, o1.to(K_CACHE.dtype.element_ty), mask=keep)
            tl.store(K_CACHE + offset + HALF + i, o2.to(K_CACHE.dtype.element_ty), mask=keep)
        v_src = src + KV_HEADS * dim  # v head kv sits kv_heads heads after k head kv
        v1 = tl.load(v_src + i, mask=keep, other=0.0)
        v2 = tl.load(v_src + HALF + i, mask=keep, other=0.0)
        if FP8_KV:
            v1 = quantize_fp8(v1, v_scale, V_CACHE.dtype.element_ty)
            v2 = quantize_fp8(v2, v_scale, V_CACHE.dtype.element_ty)
        tl.store(V_CACHE + offset + i, v1.to(V_CACHE.dtype.element_ty), mask=keep)
        tl.store(V_CACHE + offset + HALF + i, v2.to(V_CACHE.dtype.element_ty), mask=keep)


def supports(
    qkv: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, head_dim: int
) -> bool:
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
    q_norm/k_norm [head_dim] or both None; cos/sin [rows, head_dim / 2] float32 (last dim
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
    # The reference's norm output takes torch's promotion of weight and input; rotary then
    # rounds in that dtype. q comes back in qkv's dtype regardless.
    dtype = torch.promote_types(q_norm.dtype, qkv.dtype) if norm else qkv.dtype
    half = head_dim // 2
    half_pad = triton.next_power_of_2(half)
    _qkv_kernel[(rows, heads + kv_heads)](
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
        layout.eps,
        float(k_scale),
        float(v_scale),
        HEADS=heads,
        KV_HEADS=kv_heads,
        HALF=half,
        HALF_PAD=half_pad,
        INTERLEAVE=layout.interleave,
        NORM=norm,
        DT=_TL_DTYPES[dtype],
        FP8_KV=k_cache.dtype == torch.float8_e4m3fn,
        num_warps=max(1, min(4, half_pad // 64)),
        enable_fp_fusion=False,
    )
    return q
