"""RMSNorm as one Triton launch (the eager form is six small kernels per call), alone or fused with
the residual add that precedes it in every layer (`h = h + delta; x = norm(h)`), and optionally
with the per-row, per-128-group FP8 quantization of its output for the w8a8 GEMM it feeds
(`add_rms_norm_fp8`: one launch fewer than the norm, then fp8_w8a8.quantize_rows).

Numerics follow the reference: statistics in float32, the normalised row rounded to the input
dtype, then multiplied by the weight in the weight's dtype (one rounding, as torch's bf16 multiply).
Quantized, that product is rounded to the output dtype first, then scaled by the group's power of
two and rounded to e4m3: quantize_rows' values and scales bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.reference.fp8 import FP8_DTYPE, FP8_MAX, GROUP, Fp8Rows, scale_groups
from afdserve.kernels.triton.fp8_weight_only import exact_shift


@triton.jit
def _rms_norm_kernel(
    X,
    W,
    Y,
    D,
    H,
    S,
    stride_x,
    stride_y,
    stride_d,
    stride_h,
    width,
    eps,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    FP8: tl.constexpr = False,
    GROUP: tl.constexpr = 128,
    FP8_LIMIT: tl.constexpr = 448.0,
):
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        # The sum is rounded to the stream's dtype before the statistics, as `h + delta` is.
        x = (
            x.to(tl.float32)
            + tl.load(D + row * stride_d + cols, mask=mask, other=0.0).to(tl.float32)
        ).to(X.dtype.element_ty)
        tl.store(H + row * stride_h + cols, x, mask=mask)
    x = x.to(tl.float32)
    inv = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / width + eps)
    normed = (x * inv).to(X.dtype.element_ty)
    w = tl.load(W + cols, mask=mask, other=0.0)
    y = normed.to(tl.float32) * w.to(tl.float32)
    if not FP8:
        tl.store(Y + row * stride_y + cols, y.to(Y.dtype.element_ty), mask=mask)
    else:  # Y: e4m3 rows [rows, width], S: float32 scales [rows, groups] (module docstring)
        y = tl.reshape(y.to(X.dtype.element_ty).to(tl.float32), (BLOCK // GROUP, GROUP))
        shift = exact_shift(tl.maximum(tl.max(tl.abs(y), axis=1), 1e-30), FP8_LIMIT)
        q = tl.reshape(y * tl.exp2(-shift)[:, None], (BLOCK,))
        tl.store(Y + row * stride_y + cols, q.to(tl.float8e4nv), mask=mask)
        group = tl.arange(0, BLOCK // GROUP)
        tl.store(
            S + row * tl.cdiv(width, GROUP) + group, tl.exp2(shift), mask=group * GROUP < width
        )


@triton.jit
def _hybrid_norm_kernel(
    X,
    Z,
    W,
    Y,
    D,
    H,
    stride_x,
    stride_z,
    stride_d,
    width,
    eps,
    BLOCK: tl.constexpr,
    ADD: tl.constexpr,
    GATED: tl.constexpr,
    WIDE_WEIGHT: tl.constexpr,  # W's dtype is wider than X's: `weight * normed` is in W's
):
    """The Gated DeltaNet hybrids' two norms (kernels/reference/layers.py has their torch
    forms): zero-centred, x / rms(x) * (1 + w) in float32 rounded once (after `h + delta` where
    ADD, stored to H); or GATED, the plain norm's rounding times silu(z) in float32."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < width
    dtype = X.dtype.element_ty
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0)
    if ADD:
        d = tl.load(D + row * stride_d + cols, mask=mask, other=0.0)
        x = (x.to(tl.float32) + d.to(tl.float32)).to(dtype)
        tl.store(H + row * width + cols, x, mask=mask)
    f = x.to(tl.float32)
    f = f * (1.0 / tl.sqrt(tl.sum(f * f, axis=0) / width + eps))
    w = tl.load(W + cols, mask=mask, other=0.0)
    if GATED:
        z = tl.load(Z + row * stride_z + cols, mask=mask, other=0.0).to(tl.float32)
        y = f.to(dtype).to(tl.float32) * w.to(tl.float32)
        y = y.to(W.dtype.element_ty) if WIDE_WEIGHT else y.to(dtype)  # torch's promotion
        y = y.to(tl.float32) * (z * tl.sigmoid(z))
    else:
        y = f * (1.0 + w.to(tl.float32))
    tl.store(Y + row * width + cols, y.to(dtype), mask=mask)


def hybrid_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    z: torch.Tensor | None = None,
    delta: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """x [..., width] (last dim contiguous) -> (the norm [..., width] in x's dtype, h + delta or
    None): zero-centred, after the residual add where `delta` is given; or gated by z (same
    shape as x) where it is given (the two are not combined)."""
    flat = _rows(x)
    rows, width = flat.shape
    out = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    summed = None
    gate = flat if z is None else _rows(z)
    d = flat if delta is None else _rows(delta)
    if delta is not None:
        summed = torch.empty(rows, width, dtype=x.dtype, device=x.device)
    if rows:
        block = triton.next_power_of_2(width)
        _hybrid_norm_kernel[(rows,)](
            flat,
            gate,
            weight,
            out,
            d,
            out if summed is None else summed,
            flat.stride(0),
            gate.stride(0),
            d.stride(0),
            width,
            eps,
            BLOCK=block,
            ADD=delta is not None,
            GATED=z is not None,
            WIDE_WEIGHT=torch.promote_types(weight.dtype, x.dtype) != x.dtype,
            num_warps=4 if block <= 2048 else 8,
        )
    shape = x.shape
    return out.view(shape), None if summed is None else summed.view(shape)


def _rows(x: torch.Tensor) -> torch.Tensor:
    flat = x.reshape(-1, x.shape[-1])
    return flat if flat.stride(-1) == 1 else flat.contiguous()


def _launch(flat, weight, eps, delta=None, summed=None, scales=None) -> torch.Tensor:
    """`scales` given: the output is e4m3, its per-group scales written there."""
    width, rows = flat.shape[-1], flat.shape[0]
    fp8 = scales is not None
    out_dtype = FP8_DTYPE if fp8 else torch.promote_types(weight.dtype, flat.dtype)
    out = torch.empty(flat.shape, dtype=out_dtype, device=flat.device)
    if rows:
        block = max(triton.next_power_of_2(width), GROUP if fp8 else 1)
        add = delta is not None
        d, h = (delta, summed) if add else (flat, flat)  # placeholders when not adding
        _rms_norm_kernel[(rows,)](
            flat,
            weight,
            out,
            d,
            h,
            scales if fp8 else flat,
            flat.stride(0),
            out.stride(0),
            d.stride(0),
            h.stride(0),
            width,
            eps,
            BLOCK=block,
            ADD=add,
            FP8=fp8,
            GROUP=GROUP,
            FP8_LIMIT=FP8_MAX,
            num_warps=4 if block <= 2048 else 8,
        )
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


def add_rms_norm_fp8(
    h: torch.Tensor, delta: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[Fp8Rows, torch.Tensor]:
    """`add_rms_norm` with its normalised rows quantized as triton_fp8_w8a8.quantize_rows does
    (bf16/fp16 h and weight of one dtype): (those rows, h + delta)."""
    flat, d = _rows(h), _rows(delta)
    summed = torch.empty_like(flat)
    scales = torch.empty(
        flat.shape[0], scale_groups(flat.shape[-1]), dtype=torch.float32, device=flat.device
    )
    return Fp8Rows(_launch(flat, weight, eps, d, summed, scales), scales, h.dtype), summed
