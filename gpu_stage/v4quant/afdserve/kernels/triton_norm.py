"""RMSNorm as one Triton launch (the eager form is six small kernels per call), alone or fused with
the residual add that precedes it in every layer (`h = h + delta; x = norm(h)`).

Numerics follow the reference: statistics in float32, the normalised row rounded to the input
dtype, then multiplied by the weight in the weight's dtype (one rounding, as torch's bf16 multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(
    X, W, Y, D, H, stride_x, stride_y, stride_d, stride_h, width, eps,
    BLOCK: tl.constexpr, ADD: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        # The sum is rounded to the stream's dtype before the statistics, as `h + delta` is.
        x = (x.to(tl.float32) + tl.load(D + row * stride_d + cols, mask=mask, other=0.0).to(
            tl.float32
        )).to(X.dtype.element_ty)
        tl.store(H + row * stride_h + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    normed = (x * inv).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _launch(flat, weight, eps, delta=None, summed=None) -> torch.Tensor:
    width, rows = flat.shape[-1], flat.shape[0]
    out_dtype = torch.promote_types(weight.dtype, flat.dtype)
    out = torch.empty(flat.shape, dtype=out_dtype, device=flat.device)
    if rows:
        block = triton.next_power_of_2(width)
        add = delta is not None
        d, h = (delta, summed) if add else (flat, flat)  # placeholders when not adding
        _rms_norm_kernel[(rows,)](
            flat, weight, out, d, h,
            flat.stride(0), out.stride(0), d.stride(0), h.stride(0),
            width, eps,
            BLOCK=block, ADD=add, num_warps=4 if block <= 2048 else 8,
        )  # fmt: skip
    return out


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., width] (last dim contiguous); weight [width]. Output dtype: torch's promotion of
    weight and x dtypes, as in `weight * normed`."""
    return _launch(_rows(x), weight, eps).view(*x.shape[:-1], x.shape[-1])


def add_rms_norm(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(h + delta), h + delta) for [rows, width] tensors of one dtype, in one launch."""
    flat, d = _rows(h), _rows(delta)
    summed = torch.empty_like(flat)
    return _launch(flat, weight, eps, d, summed), summed
