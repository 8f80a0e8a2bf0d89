"""Rotary embedding of one [rows, heads, dim] tensor in one Triton launch (the eager form is about
eight small kernels per tensor). Pairs are (x[i], x[i + dim/2]) or, interleaved, (x[2i], x[2i+1]);
either way the output is cat(x1*cos - x2*sin, x2*cos + x1*sin), as in the reference."""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rotary_kernel(
    X,
    COS,
    SIN,
    Y,
    stride_xr,
    stride_xh,
    stride_yr,
    stride_yh,
    stride_c,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    INTERLEAVE: tl.constexpr,
):
    row = tl.program_id(0)
    head = tl.program_id(1)
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    base = X + row * stride_xr + head * stride_xh
    if INTERLEAVE:
        x1 = tl.load(base + 2 * i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + 2 * i + 1, mask=mask, other=0.0).to(tl.float32)
    else:
        x1 = tl.load(base + i, mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(base + HALF + i, mask=mask, other=0.0).to(tl.float32)
    c = tl.load(COS + row * stride_c + i, mask=mask, other=0.0)
    s = tl.load(SIN + row * stride_c + i, mask=mask, other=0.0)
    out = Y + row * stride_yr + head * stride_yh
    tl.store(out + i, (x1 * c - x2 * s).to(Y.dtype.element_ty), mask=mask)
    tl.store(out + HALF + i, (x2 * c + x1 * s).to(Y.dtype.element_ty), mask=mask)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleave: bool) -> torch.Tensor:
    """x [rows, heads, dim]; cos/sin [rows, dim / 2] float32."""
    rows, heads, dim = x.shape
    if x.stride(-1) != 1:
        x = x.contiguous()
    cos, sin = cos.float().contiguous(), sin.float().contiguous()
    out = torch.empty(rows, heads, dim, dtype=x.dtype, device=x.device)
    if rows:
        half = dim // 2
        _rotary_kernel[(rows, heads)](
            x,
            cos,
            sin,
            out,
            x.stride(0),
            x.stride(1),
            out.stride(0),
            out.stride(1),
            cos.stride(0),
            HALF=half,
            HALF_PAD=triton.next_power_of_2(half),
            INTERLEAVE=interleave,
        )
    return out


@triton.jit
def _cos_sin_kernel(POSITIONS, INV_FREQ, COS, SIN, rows, scaling, HALF: tl.constexpr,
                    ROWS: tl.constexpr, HALF_PAD: tl.constexpr):  # fmt: skip
    row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    i = tl.arange(0, HALF_PAD)
    ok = (row < rows)[:, None] & (i < HALF)[None, :]
    position = tl.load(POSITIONS + row, mask=row < rows, other=0).to(tl.float32)
    freqs = position[:, None] * tl.load(INV_FREQ + i, mask=i < HALF, other=0.0)[None, :]
    out = row.to(tl.int64)[:, None] * HALF + i[None, :]
    # libdevice's cosf/sinf (range-reduced, as torch's CUDA cos/sin), then the one multiply.
    tl.store(COS + out, tl.cos(freqs) * scaling, mask=ok)
    tl.store(SIN + out, tl.sin(freqs) * scaling, mask=ok)


def cos_sin(
    positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [rows, half] float32 of positions [rows] (any integer dtype) times inv_freq
    [half] float32, each times `scaling`: DeepSeek-V4's `RopeTable.at` in one launch, where torch
    takes six (the cast, the product, cos, sin and two scalings)."""
    rows, half = positions.shape[0], inv_freq.shape[0]
    cos = torch.empty(rows, half, dtype=torch.float32, device=positions.device)
    sin = torch.empty_like(cos)
    if rows == 0:
        return cos, sin
    block = 16
    _cos_sin_kernel[(triton.cdiv(rows, block),)](
        positions.contiguous(),
        inv_freq.contiguous(),
        cos,
        sin,
        rows,
        float(scaling),
        HALF=half,
        ROWS=block,
        HALF_PAD=triton.next_power_of_2(half),
        num_warps=4,
    )
    return cos, sin
