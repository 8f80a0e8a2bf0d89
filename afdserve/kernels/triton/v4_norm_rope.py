"""DeepSeek-V4's per-head RMS norm and partial interleaved rotary (model/families/deepseek_v4/:
`unweighted_rms_norm`, `v4_rms_norm`, `rope_tail`) in one launch: the query heads, the shared KV
row, the low-rank query residual, the indexer's queries and the rotary undone on the attention
output each take one instead of six to twenty small kernels.

One program per (row, head): the head's `dim` channels as interleaved pairs (x[2i], x[2i+1]). The
norm (NORM 0: none; 1: unweighted, x * rsqrt(mean x^2 + eps) rounded to x's dtype first, as
`unweighted_rms_norm`; 2: weighted, w * (x * rsqrt(...)) in float32 rounded once, as
`v4_rms_norm`), rounded to x's dtype; then the trailing PAIRS pairs rotated by the row's cos/sin
(rounded to x's dtype first, the rotation in float32, rounded once, as `rope_tail`; `NEGATE`
rotates back).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_kernel(
    X,  # [rows, heads, DIM]: heads dense, rows `row` apart
    OUT,  # [rows, heads, DIM] contiguous
    WEIGHT,  # [DIM] (NORM 2)
    COS,  # [rows, PAIRS] float32
    SIN,  # [rows, PAIRS] float32
    heads,
    row,
    eps,
    DIM: tl.constexpr,
    PAIRS: tl.constexpr,
    NORM: tl.constexpr,
    NEGATE: tl.constexpr,
    BLOCK: tl.constexpr,  # a power of two >= DIM / 2
):
    # 64-bit rows: V4's q is 32768 elements a token, 2^31 past 65536 tokens a step.
    r, head = tl.program_id(0).to(tl.int64), tl.program_id(1)
    dtype = X.dtype.element_ty
    i = tl.arange(0, BLOCK)
    inside = i < DIM // 2
    base = (r * heads + head) * DIM
    at = r * row + head * DIM
    even = tl.load(X + at + 2 * i, mask=inside, other=0.0).to(tl.float32)
    odd = tl.load(X + at + 2 * i + 1, mask=inside, other=0.0).to(tl.float32)
    if NORM != 0:
        mean = (tl.sum(even * even, axis=0) + tl.sum(odd * odd, axis=0)) / DIM
        inv = 1.0 / tl.sqrt(mean + eps)
        if NORM == 1:
            inv = inv.to(dtype).to(tl.float32)
            even = (even * inv).to(dtype).to(tl.float32)
            odd = (odd * inv).to(dtype).to(tl.float32)
        else:
            w_even = tl.load(WEIGHT + 2 * i, mask=inside, other=0.0).to(tl.float32)
            w_odd = tl.load(WEIGHT + 2 * i + 1, mask=inside, other=0.0).to(tl.float32)
            even = (w_even * (even * inv)).to(dtype).to(tl.float32)
            odd = (w_odd * (odd * inv)).to(dtype).to(tl.float32)
    if PAIRS > 0:
        pair = i - (DIM // 2 - PAIRS)
        rotated = inside & (pair >= 0)
        cos = tl.load(COS + r * PAIRS + pair, mask=rotated, other=1.0).to(dtype).to(tl.float32)
        sin = tl.load(SIN + r * PAIRS + pair, mask=rotated, other=0.0).to(dtype).to(tl.float32)
        if NEGATE:
            sin = -sin
        even, odd = (
            tl.where(rotated, even * cos - odd * sin, even),
            tl.where(rotated, odd * cos + even * sin, odd),
        )
    tl.store(OUT + base + 2 * i, even.to(OUT.dtype.element_ty), mask=inside)
    tl.store(OUT + base + 2 * i + 1, odd.to(OUT.dtype.element_ty), mask=inside)


def supports(x: torch.Tensor) -> bool:
    """x [rows, heads, dim] with dense heads (rows may lie apart: a slice of a packed GEMM's
    output), a float dtype, an even dim."""
    return (
        x.dim() == 3
        and x.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and x.stride(2) == 1
        and (x.shape[1] == 1 or x.stride(1) == x.shape[2])
        and x.shape[-1] % 2 == 0
        and x.shape[-1] <= 8192
    )


def norm_rope(
    x: torch.Tensor,
    norm: tuple[torch.Tensor | None, float] | None,
    cos_sin: tuple[torch.Tensor, torch.Tensor] | None,
    negate: bool = False,
) -> torch.Tensor:
    """x [rows, heads, dim] (`supports`' strides) -> the same shape and dtype, contiguous.
    norm: None, (None, eps) unweighted or (weight, eps); cos_sin: None or cos, sin [rows, pairs]
    float32 of the trailing pairs."""
    rows, heads, dim = x.shape
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    if rows == 0 or heads == 0:
        return out
    mode = 0 if norm is None else (1 if norm[0] is None else 2)
    weight = x if mode != 2 else norm[0]
    cos, sin = cos_sin if cos_sin is not None else (out, out)  # placeholders, never read
    pairs = 0 if cos_sin is None else cos.shape[-1]
    _norm_rope_kernel[(rows, heads)](
        x,
        out,
        weight,
        cos.contiguous(),
        sin.contiguous(),
        heads,
        x.stride(0),
        0.0 if norm is None else norm[1],
        DIM=dim,
        PAIRS=pairs,
        NORM=mode,
        NEGATE=negate,
        BLOCK=triton.next_power_of_2(max(dim // 2, 1)),
    )
    return out
