"""The fp8 A2E format (kernels/a2e.py) in Triton, one launch per call: quantize rows,
dequantize rows, and the round trip a boundary with no wire runs (pad rows zeroed, quantized,
dequantized) without writing the fp8 rows or their scales anywhere.

Bit for bit a2e.py's torch functions (the oracle): each step is one correctly rounded float32
operation in torch's order. amax is exact; the scale is the float32 product with torch's constant
(1 / 448 rounded once to float32); the quotient is `tl.div_rn` (Triton's `/` is approximate on
the GPU); after the clamp the rounding to e4m3 is to nearest even (`_e4m3_grid`); dequantizing is
the float32 product of the e4m3 value and its scale, cast to nearest even. The fused round trip
multiplies the float32 value the e4m3 byte would hold, so it never casts. A NaN in a group makes
its amax and scale NaN, as torch's does (Triton's plain max would drop it); test_a2e_compile.py
checks the PTX for no fma, no flush of subnormals and no approximate division.
A program takes `BLOCK_G` groups of one row; masked channels past the row load as zeros, which
raise no amax (a2e.py's zero padding). No host sync, no data-dependent allocation: graphable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.reference.fp8 import FP8_DTYPE, FP8_MAX, GROUP, scale_groups

# The float32 torch multiplies an amax by: `float32 tensor * python float` rounds the scalar to
# float32 once (the op's math type), then multiplies in float32.
INV_MAX = float(torch.tensor(1.0 / FP8_MAX, dtype=torch.float32))
DTYPES = (torch.bfloat16, torch.float16, torch.float32)
_TL = {torch.bfloat16: tl.bfloat16, torch.float16: tl.float16, torch.float32: tl.float32}


@triton.jit
def _nan_max(a, b):
    return tl.maximum(a, b, propagate_nan=tl.PropagateNan.ALL)


@triton.jit
def _tile(hidden, BLOCK_G: tl.constexpr, GROUP: tl.constexpr):
    """(group indices [BLOCK_G], channel offsets [BLOCK_G, GROUP], their mask) of this program."""
    groups = tl.program_id(1) * BLOCK_G + tl.arange(0, BLOCK_G)
    cols = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    return groups, cols, cols < hidden


@triton.jit
def _e4m3_grid(y):
    """float32 y (|y| <= 448, or NaN) rounded to the nearest float8_e4m3fn value, ties to even,
    still in float32, so the cast to e4m3 after it is exact. The GPU's cast (cvt.rn) rounds the
    same way; this is written out because Triton's interpreter rounds its fp8 casts wrongly (a
    half up, and a carry out of the mantissa lost), and with it the CPU tests check what the GPU
    runs. c = 2^(e + 20), e |y|'s exponent (at least -6, e4m3's least normal one), is a float32
    whose last bit is e4m3's step at |y|: |y| + c rounds |y| to that step, ties to even, and
    taking c off again is exact. c is built from bits, not multiplied, so that no fma fuses."""
    bits = y.to(tl.int32, bitcast=True)
    c = (tl.maximum(bits & 0x7F800000, 121 << 23) + (20 << 23)).to(tl.float32, bitcast=True)
    r = (tl.abs(y) + c) - c
    return tl.where(bits < 0, r * -1.0, r)  # the sign back: -0.0 too, which 0 - r would lose


@triton.jit
def _quantize(x, INV_MAX: tl.constexpr, FP8_MAX: tl.constexpr):
    """float32 [BLOCK_G, GROUP] -> (q [BLOCK_G, GROUP], scales [BLOCK_G]), as a2e.quantize_rows:
    q float32 holding float8_e4m3fn values."""
    amax = tl.reduce(tl.abs(x), 1, _nan_max)
    scales = amax * INV_MAX
    divisor = tl.where(scales > 0, scales, 1.0)  # a zero group divides by 1, keeps scale 0
    y = tl.div_rn(x, tl.broadcast_to(divisor[:, None], x.shape))
    y = tl.clamp(y, -FP8_MAX, FP8_MAX, propagate_nan=tl.PropagateNan.ALL)
    return _e4m3_grid(y), scales


@triton.jit
def _quantize_kernel(
    X,
    Q,
    S,
    hidden,
    n_groups,
    stride_x,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
    INV_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups, cols, mask = _tile(hidden, BLOCK_G, GROUP)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    q, scales = _quantize(x, INV_MAX, FP8_MAX)
    tl.store(Q + row * hidden + cols, q.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)
    tl.store(S + row * n_groups + groups, scales, mask=groups < n_groups)


@triton.jit
def _dequantize_kernel(
    Q,
    S,
    Y,
    hidden,
    n_groups,
    stride_q,
    stride_s,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
    OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups, cols, mask = _tile(hidden, BLOCK_G, GROUP)
    q = tl.load(Q + row * stride_q + cols, mask=mask, other=0.0).to(tl.float32)
    scales = tl.load(S + row * stride_s + groups, mask=groups < n_groups, other=0.0)
    y = q * scales[:, None]
    tl.store(Y + row * hidden + cols, y.to(OUT, fp_downcast_rounding="rtne"), mask=mask)


@triton.jit
def _roundtrip_kernel(
    X,
    IDS,
    Y,
    hidden,
    stride_x,
    HAS_IDS: tl.constexpr,
    BLOCK_G: tl.constexpr,
    GROUP: tl.constexpr,
    INV_MAX: tl.constexpr,
    FP8_MAX: tl.constexpr,
    OUT: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    groups, cols, mask = _tile(hidden, BLOCK_G, GROUP)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_IDS:  # a pad row (route id -1) is zeros, as a2e.pad_zeroed makes it
        x = tl.where(tl.load(IDS + row) < 0, 0.0, x)
    q, scales = _quantize(x, INV_MAX, FP8_MAX)
    y = q * scales[:, None]  # q is float32 already: no fp8 in between
    tl.store(Y + row * hidden + cols, y.to(OUT, fp_downcast_rounding="rtne"), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _launch(hidden: int) -> tuple[int, int, int]:
    """(BLOCK_G, programs per row, num_warps): up to 8 groups (1024 channels) a program."""
    n_groups = scale_groups(hidden)
    block_g = min(triton.next_power_of_2(max(n_groups, 1)), 8)
    return block_g, -(-n_groups // block_g), 4 if block_g >= 4 else 1


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, hidden] -> (q float8_e4m3fn [rows, hidden], scales float32 [rows, groups])."""
    x = _rows(x)
    rows, hidden = x.shape
    n_groups = scale_groups(hidden)
    q = torch.empty(rows, hidden, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(rows, n_groups, dtype=torch.float32, device=x.device)
    block_g, per_row, warps = _launch(hidden)
    if rows and hidden:
        _quantize_kernel[(rows, per_row)](
            x,
            q,
            scales,
            hidden,
            n_groups,
            x.stride(0),
            BLOCK_G=block_g,
            GROUP=GROUP,
            INV_MAX=INV_MAX,
            FP8_MAX=FP8_MAX,
            num_warps=warps,
        )
    return q, scales


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [rows, hidden] float8_e4m3fn, scales float32 [rows, groups]) -> x [rows, hidden]."""
    q = _rows(q)
    scales = _rows(scales)
    rows, hidden = q.shape
    y = torch.empty(rows, hidden, dtype=dtype, device=q.device)
    block_g, per_row, warps = _launch(hidden)
    if rows and hidden:
        _dequantize_kernel[(rows, per_row)](
            q,
            scales,
            y,
            hidden,
            scales.shape[1],
            q.stride(0),
            scales.stride(0),
            BLOCK_G=block_g,
            GROUP=GROUP,
            OUT=_TL[dtype],
            num_warps=warps,
        )
    return y


def roundtrip(
    x: torch.Tensor, dtype: torch.dtype, route_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """dequantize_rows(*quantize_rows(x), dtype) in one launch, the rows whose route id is
    negative zeroed first when `route_ids` [rows] is given; no fp8 intermediate in memory."""
    x = _rows(x)
    rows, hidden = x.shape
    y = torch.empty(rows, hidden, dtype=dtype, device=x.device)
    block_g, per_row, warps = _launch(hidden)
    if rows and hidden:
        ids = route_ids.contiguous() if route_ids is not None else x  # x: a placeholder
        _roundtrip_kernel[(rows, per_row)](
            x,
            ids,
            y,
            hidden,
            x.stride(0),
            HAS_IDS=route_ids is not None,
            BLOCK_G=block_g,
            GROUP=GROUP,
            INV_MAX=INV_MAX,
            FP8_MAX=FP8_MAX,
            OUT=_TL[dtype],
            num_warps=warps,
        )
    return y
