"""The weights `fp4_decode.fp4_reduce` decodes, read back exactly (tests/gpu/test_fp4_moe.py):
its dots over one-hot rows (row r the unit vector of input r), so each sum has one nonzero term
and every output is a weight as the kernel saw it. Imported by the GPU test only (needs
Triton)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe import fp4_decode as k


@triton.jit
def _read_back(
    eye,
    w,
    s,
    out,
    dim,
    w_row,
    s_row,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    inputs = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    cols = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    acc = k._acc_zeros(ROWS, COLUMNS, WEIGHTS_LEFT)
    x_rows = eye + inputs[:, None] * dim
    acc = k.fp4_reduce(
        acc, x_rows, w + cols * w_row, s + cols * s_row, dim, ROWS, COLUMNS, K_BLOCK, TAIL,
        WEIGHTS_LEFT, ONE_DOT,
    )  # fmt: skip
    tl.store(out + cols[None, :] * dim + inputs[:, None], k._rows_major(acc, WEIGHTS_LEFT))


def decoded_weights(
    stack: tuple[torch.Tensor, torch.Tensor],
    dtype: torch.dtype,
    weights_left: bool,
    one_dot: bool = False,
) -> torch.Tensor:
    """stack: (packed [out, in / 2], scales [out, in / 32]) on CUDA, out a multiple of 64 -> the
    decoded weights [out, in], float32, for rows of `dtype` (`one_dot`: `Tiles.one_dot`'s K
    order)."""
    packed, scale = stack
    rows, dim = packed.shape[0], 2 * packed.shape[1]
    tiles, columns = k.TILES[0][1], 64
    out = torch.empty(rows, dim, device=packed.device)
    eye = torch.eye(dim, device=packed.device, dtype=dtype)
    _read_back[(dim // tiles.rows, rows // columns)](
        eye,
        packed.view(torch.int32),
        scale,
        out,
        dim,
        dim // 8,
        dim // 32,
        ROWS=tiles.rows,
        COLUMNS=columns,
        WEIGHTS_LEFT=weights_left,
        ONE_DOT=one_dot,
        **k.k_constants(dim, tiles.k_block),
    )
    return out
