"""FP8 routed experts for decode batches: decode.py's three launches over FP8 stacks.

The experts stay float8_e4m3fn, gate_up [E, 2I, H] and down [E, H, I], each with a float32 scale
per 128 x 128 block (model/layers/fp8.py's layout: gate_up's grid holds gate's block rows, then
up's). Routing is in registers as in decode.py (moe/routing.py). Each weight tile lies in one
scale block, so a dot's float32 partial is scaled once (triton/fp8_weight_only.py's block_dot).
w8a8 by default (fp8_weight_only.W8A8_EXPERTS): x and h are quantized per row and group of 128
and the dots run on FP8 tensor cores; `a8=False` runs them in x's dtype against the FP8 values.
The weight tile is the dots' left operand (`WEIGHTS_LEFT`, out^T = W x^T): the weight rows are
the MMA's M and the pairs its N, so a batch of 1 takes 8-row tiles of pairs (`LEFT_ROWS`, the
smallest N) where an M is at least 16; a program's gate and up rows are one tile of 2 * COLUMNS
rows, one dot, each half with its own block scale. No load is masked: columns past the last
read its weights, rows past a tile's pairs read pair 0's row; neither is stored. Batches past
MAX_PAIRS take grouped.py with the same dequantization. No host sync.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe.decode import _k_block, _tiles, sum_pairs
from afdserve.kernels.moe.routing import decode_launch, program_pairs, tile_pairs
from afdserve.kernels.reference.fp8 import FP8_DTYPE
from afdserve.kernels.triton import fp8_weight_only as triton_fp8
from afdserve.kernels.triton.fp8_weight_only import (
    as_operand,
    block_dot_left,
    down_tile,
    gate_up_right,
)

SCALE_BLOCK = 128
# Pairs up to which `ops.moe_experts_fp8` takes these kernels (a batch of 1 at top-8); past it the
# sort-free grouped GEMM was faster on an H200 (docs/benchmarks.md, "Kernel constants").
MAX_PAIRS = 8
# Whether the weight tile is the dots' left operand (out^T = W x^T, module docstring); False
# keeps the first orientation (out = x W^T), to time one against the other.
WEIGHTS_LEFT = True
# Pairs per tile with the weights left, up to MAX_PAIRS pairs (so one tile holds all of an
# expert's): 8, the smallest N of an MMA (16 is the smallest M, so the old orientation's floor).
LEFT_ROWS = 8
# Columns per gate/up and down program with the weights left: the fastest of
# `tools/fp8_moe_bench.py --variants` on an H200 (docs/benchmarks.md, "Kernel constants").
LEFT_COLUMNS = (64, 128)


class Tiles(NamedTuple):
    """One launch's shape: columns per gate/up and per down program, pairs of one expert per
    tile (None: triton_moe's choice by load), warps, pipeline stages, the weights' operand."""

    gate_up_columns: int
    down_columns: int
    rows: int | None
    warps: int
    stages: int
    weights_left: bool


def tiles_for(pairs: int, weights_left: bool | None = None) -> Tiles:
    """triton_moe's decode tiles by pair count (the FP8 sweep found none faster in the first
    orientation); with the weights left, LEFT_COLUMNS and LEFT_ROWS-row tiles up to MAX_PAIRS."""
    left = WEIGHTS_LEFT if weights_left is None else weights_left
    gate_up, down, warps, stages = _tiles(pairs)
    if left and pairs <= MAX_PAIRS:
        return Tiles(*LEFT_COLUMNS, LEFT_ROWS, warps, stages, True)
    return Tiles(gate_up, down, None, warps, stages, left)


def supports(
    x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor, block: tuple[int, int]
) -> bool:
    """bf16/fp16 activations, contiguous FP8 stacks of 128 x 128 blocks, reduction dims that are
    multiples of 16 (tl.dot's smallest K step)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not (gate_up.dtype == down.dtype == FP8_DTYPE) or tuple(block) != (128, 128):
        return False
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        return False
    return gate_up.shape[2] % 16 == 0 and down.shape[2] % 16 == 0


@triton.jit
def _gate_up_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    s_ptr,
    h_ptr,
    num_pairs,
    top_k,
    hidden,
    inter,
    s_expert,
    s_row,
    inter_blocks,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    X_SCALED: tl.constexpr,
    A_FP8: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
):
    expert, pair, mine, rank, count, col, col_ok = program_pairs(
        ids_ptr, num_pairs, inter, PAIRS_PAD, BY_EXPERT, COLUMNS
    )
    k = tl.arange(0, K_BLOCK)
    # COLUMNS divides 128: the tile's rows share a scale row of each half's grid.
    gate_scales = s_ptr + expert * s_expert + (tl.program_id(0) * COLUMNS // 128) * s_row
    up_scales = gate_scales + inter_blocks * s_row
    if WEIGHTS_LEFT:
        # One tile of 2 * COLUMNS weight rows, these columns' gate rows and then their up rows:
        # one dot of twice the height (32 columns make the 64 rows wgmma needs at 4 warps).
        # Columns past the last (inter not a multiple of COLUMNS) read the last one's weights,
        # in the same scale block, so no load is masked; their outputs are never stored.
        r = tl.arange(0, 2 * COLUMNS)
        both_col = tl.minimum(tl.program_id(0) * COLUMNS + r % COLUMNS, inter - 1)
        both_row = expert * 2 * inter + (r // COLUMNS) * inter + both_col
        both_rows = w_ptr + both_row[:, None] * hidden + k[None, :]
        is_up = (r >= COLUMNS)[:, None]
    else:
        gate_rows = w_ptr + expert * 2 * inter * hidden + col.to(tl.int64)[:, None] * hidden
        up_rows = gate_rows + inter * hidden
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs(pair, mine, rank, first, count, ROWS)
        x_rows = x_ptr + (rows // top_k).to(tl.int64)[:, None] * hidden
        if WEIGHTS_LEFT:
            # A tile's rows past its pairs read pair 0's row (in bounds), never stored.
            acc = tl.zeros((2 * COLUMNS, ROWS), dtype=tl.float32)
            for k0 in range(0, hidden, K_BLOCK):
                xo, rs = as_operand(tl.load(x_rows + k0 + k[None, :]), X_SCALED, A_FP8)
                scale = tl.where(
                    is_up, tl.load(up_scales + k0 // 128), tl.load(gate_scales + k0 // 128)
                )
                acc = block_dot_left(xo, rs, tl.load(both_rows + k0), scale, acc, X_SCALED)
            # [2C, ROWS] -> [ROWS, 2, C] -> [ROWS, C, 2] -> gate and up, [ROWS, C] each.
            both = tl.permute(tl.reshape(tl.trans(acc), (ROWS, 2, COLUMNS)), (0, 2, 1))
            gate, up = tl.split(both)
        else:
            gate, up = gate_up_right(
                x_rows,
                row_ok,
                gate_rows,
                up_rows,
                col_ok,
                gate_scales,
                up_scales,
                hidden,
                k,
                True,
                X_SCALED,
                A_FP8,
                ROWS,
                COLUMNS,
                K_BLOCK,
            )
        act = gate / (1.0 + tl.exp(-gate)) * up
        out = h_ptr + rows[:, None] * inter + col[None, :]
        tl.store(out, act.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    ids_ptr,
    weights_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    num_pairs,
    hidden,
    inter,
    s_expert,
    s_row,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    X_SCALED: tl.constexpr,
    A_FP8: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
):
    expert, pair, mine, rank, count, col, col_ok = program_pairs(
        ids_ptr, num_pairs, hidden, PAIRS_PAD, BY_EXPERT, COLUMNS
    )
    k = tl.arange(0, K_BLOCK)
    if WEIGHTS_LEFT:  # columns past the last read its weights (as in gate/up)
        load_col = tl.minimum(col, hidden - 1).to(tl.int64)
        down_rows = w_ptr + expert * hidden * inter + load_col[:, None] * inter + k[None, :]
    else:
        down_rows = w_ptr + expert * hidden * inter + col.to(tl.int64)[:, None] * inter
    scales = s_ptr + expert * s_expert + (tl.program_id(0) * COLUMNS // 128) * s_row
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs(pair, mine, rank, first, count, ROWS)
        h_rows = h_ptr + rows[:, None] * inter
        acc = down_tile(
            h_rows,
            row_ok,
            down_rows,
            col_ok,
            scales,
            inter,
            k,
            True,
            X_SCALED,
            A_FP8,
            WEIGHTS_LEFT,
            ROWS,
            COLUMNS,
            K_BLOCK,
        )
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        out = y_ptr + rows[:, None] * hidden + col[None, :]
        tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    a8: bool | None = None,
    tiles: Tiles | None = None,
) -> torch.Tensor:
    """`fp8.moe_experts_fp8`'s contract on CUDA for up to MAX_PAIRS pairs: x [rows, hidden];
    gate_up / down as (FP8 stack, scale grid); `a8` as in triton_grouped_moe.moe_experts;
    `tiles`: the launch's shape (None: `tiles_for`'s, the orientation `WEIGHTS_LEFT`'s). Each id
    is a held expert or -1 (no expert here: the pair is skipped). Check `supports` first."""
    (w13, s13), (w2, s2) = gate_up, down
    rows, top_k = topk_ids.shape
    pairs = rows * top_k
    hidden, inter = w13.shape[2], w2.shape[2]
    if pairs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    s13, s2 = s13.contiguous(), s2.contiguous()
    experts = w13.shape[0]
    a8 = triton_fp8.W8A8_EXPERTS if a8 is None else a8
    tiles = tiles_for(pairs) if tiles is None else tiles
    launch = decode_launch(x, topk_ids, topk_weights, experts, inter, tiles.rows)
    routing = dict(**launch.routing, WEIGHTS_LEFT=tiles.weights_left)
    gate_up_columns, down_columns, _, warps, stages, _ = tiles
    # Each FP8 tile must lie in one scale block (triton_fp8.block_dot).
    assert SCALE_BLOCK % gate_up_columns == 0 and SCALE_BLOCK % down_columns == 0
    _gate_up_kernel[(triton.cdiv(inter, gate_up_columns), launch.slots)](
        x,
        launch.ids,
        w13,
        s13,
        launch.h,
        pairs,
        top_k,
        hidden,
        inter,
        s13.stride(0),
        s13.stride(1),
        triton.cdiv(inter, SCALE_BLOCK),
        **routing,
        COLUMNS=gate_up_columns,
        K_BLOCK=_k_block(hidden),
        num_warps=warps,
        num_stages=stages,
        **triton_fp8.operand_modes(a8, _k_block(hidden), x.dtype),
    )
    _down_kernel[(triton.cdiv(hidden, down_columns), launch.slots)](
        launch.h,
        launch.ids,
        launch.weights,
        w2,
        s2,
        launch.y,
        pairs,
        hidden,
        inter,
        s2.stride(0),
        s2.stride(1),
        **routing,
        COLUMNS=down_columns,
        K_BLOCK=_k_block(inter),
        num_warps=warps,
        num_stages=stages,
        **triton_fp8.operand_modes(a8, _k_block(inter), x.dtype),
    )
    return sum_pairs(launch.y, launch.ids, launch.out, experts)
