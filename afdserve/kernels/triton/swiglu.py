"""silu(gate) * up as one Triton launch, the activation of the shared experts and dense layers
(`GatedMLP`): torch's form is two kernels, five with DeepSeek-V4's clamps. Numerics as torch's on
CUDA: the clamps in the rows' dtype, silu as x / (1 + e^-x) in float32 rounded to that dtype, the
product rounded once."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

BLOCK = 1024  # columns a program takes (not measured)


@triton.jit
def _swiglu_kernel(
    G,
    U,
    Y,
    END,
    width,
    stride_g,
    stride_u,
    limit,
    HAS_LIMIT: tl.constexpr,
    HAS_END: tl.constexpr,
    BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    if HAS_END:  # rows from END[0] on hold no values (a grouped GEMM's rows past its groups)
        if row >= tl.load(END):
            return
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < width
    g = tl.load(G + row * stride_g + cols, mask=ok, other=0.0)
    u = tl.load(U + row * stride_u + cols, mask=ok, other=0.0)
    dtype = g.dtype
    if HAS_LIMIT:  # gate clamped from above, up on both sides, each rounded to the rows' dtype
        g = tl.minimum(g.to(tl.float32), limit).to(dtype)
        u = tl.minimum(tl.maximum(u.to(tl.float32), -limit), limit).to(dtype)
    gf = g.to(tl.float32)
    silu = (gf / (1.0 + tl.exp(-gf))).to(dtype)
    y = (silu.to(tl.float32) * u.to(tl.float32)).to(dtype)
    tl.store(Y + row * width + cols, y, mask=ok)


def supports(gate: torch.Tensor, up: torch.Tensor) -> bool:
    """Rows [rows, width] of one float dtype and shape, each row contiguous."""
    return (
        gate.dim() == 2
        and gate.shape == up.shape
        and gate.dtype == up.dtype
        and gate.dtype in (torch.float16, torch.bfloat16, torch.float32)
        and gate.stride(-1) == 1
        and up.stride(-1) == 1
    )


def swiglu(
    gate: torch.Tensor,
    up: torch.Tensor,
    limit: float | None = None,
    rows_end: torch.Tensor | None = None,
) -> torch.Tensor:
    """silu(gate) * up [rows, width] (`supports`), with `limit`: gate clamped to <= limit and up
    to [-limit, limit] first. `rows_end`: a one-element int32 tensor on the rows' device; rows
    from its value on are neither read nor written (known on the device only: no host sync)."""
    rows, width = gate.shape
    out = torch.empty(rows, width, dtype=gate.dtype, device=gate.device)
    if rows and width:
        _swiglu_kernel[(rows, triton.cdiv(width, BLOCK))](
            gate,
            up,
            out,
            gate if rows_end is None else rows_end,  # never read without it
            width,
            gate.stride(0),
            up.stride(0),
            0.0 if limit is None else float(limit),
            HAS_LIMIT=limit is not None,
            HAS_END=rows_end is not None,
            BLOCK=BLOCK,
            num_warps=4,
        )
    return out
