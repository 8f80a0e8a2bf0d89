"""RMSNorm as one Triton launch (the eager form is six small kernels per call).

Numerics follow the reference: statistics in float32, the normalised row rounded to the input
dtype, then multiplied by the weight in the weight's dtype (one rounding, as torch's bf16 multiply).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(X, W, Y, stride_x, stride_y, width, eps, BLOCK: tl.constexpr):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    normed = (x * inv).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """x [..., width] (last dim contiguous); weight [width]. Output dtype: torch's promotion of
    weight and x dtypes, as in `weight * normed`."""
    width = x.shape[-1]
    flat = x.reshape(-1, width)
    if flat.stride(-1) != 1:
        flat = flat.contiguous()
    out_dtype = torch.promote_types(weight.dtype, x.dtype)
    out = torch.empty(flat.shape, dtype=out_dtype, device=x.device)
    rows = flat.shape[0]
    if rows:
        block = triton.next_power_of_2(width)
        _rms_norm_kernel[(rows,)](
            flat,
            weight,
            out,
            flat.stride(0),
            out.stride(0),
            width,
            eps,
            BLOCK=block,
            num_warps=4 if block <= 2048 else 8,
        )
    return out.view(*x.shape[:-1], width)
