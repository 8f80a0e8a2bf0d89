"""Routed experts for larger batches as a grouped GEMM in Triton, reading rows by indirection.

align.py groups the step's (token, k) pairs by expert into padded tiles of `rows` slots, no sort;
a program finds its tile's expert from the group ends (routing.tile_rows; tiles past the last
group exit at once: the grid is static per pair count). Three launches, no gather or scatter:
1. gate/up: per (tile, intermediate column block), the tile's x rows loaded by token index
   against the expert's weight tile, read once: h[pair] = silu(x W_gate^T) * (x W_up^T)
   (with DeepSeek-V4's clamps, and gpt-oss's biases and gain, as decode.py computes them).
2. down:    the same tiles over hidden column blocks: y[pair] = weight[pair] * (h[pair] W_down^T
   (+ gpt-oss's bias)).
3. sum:     out[row] = sum of the row's routed y rows (pairs of id -1 skipped: decode.sum_pairs).
Weights: bf16/fp16 stacks (gate_up [E, 2I, H], down [E, H, I]), or FP8 with a float32 scale per
128 x 128 block (model/layers/fp8.py's layout) applied to the dot's float32 partial: w8a8 by
default (x and h quantized per row and group of 128: fp8_weight_only.W8A8_EXPERTS), else on the
FP8 values cast to x's dtype. FP8 tiles are the dots' left operand (`FP8_WEIGHTS_LEFT`, as in
fp8_decode.py; a down tile may span whole scale blocks, each row scaled by its own) and the
16-row tiles of pairs the N; bf16 weights stay the right operand.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe.align import assign
from afdserve.kernels.moe.decode import _k_block, glu_act, sum_pairs
from afdserve.kernels.moe.routing import in_row_chunks, tile_rows
from afdserve.kernels.reference.fp8 import FP8_DTYPE
from afdserve.kernels.reference.layers import ExpertGLU
from afdserve.kernels.triton import fp8_weight_only as triton_fp8
from afdserve.kernels.triton.fp8_weight_only import (
    as_operand,
    block_dot_left,
    down_tile,
    gate_up_right,
)

# Pairs up to which `ops.moe_experts` takes this path for bf16/fp16 experts (above
# triton_moe.MAX_PAIRS); past it (prefill chunks) torch's grouped GEMM, whose sort and copies are
# small against its compute. A batch of 1024 at top-8: the routed experts of Qwen3-30B-A3B are
# still memory-bound there by the FLOP count (~4x), so tiles of at most 64 rows lose little.
# Untimed. FP8 experts take this path at any count (the alternative is a bf16 copy of them), in
# slices of this many pairs.
GROUPED_MAX_PAIRS = 8192

# Tile widths and launch settings: (intermediate columns per gate/up program, hidden columns per
# down program, warps, pipeline stages).
COLUMNS = (64, 64, 4, 3)
# The same for FP8 weights: gate/up tiles of 128 columns; down tiles of 256 (two scale blocks'
# rows, weights left) load and quantize each h tile once for twice the weight bytes. The sweep
# that chose them is in docs/benchmarks.md ("Kernel constants").
FP8_COLUMNS = (128, 256, 4, 3)
# Whether FP8 weight tiles are the dots' left operand (out^T = W x^T, module docstring): faster
# decode steps on an H200 (docs/benchmarks.md, "Kernel constants"); both orders are the oracle's
# within the same tolerance (tests/gpu/test_fp8_kernels.py). bf16 weights are always the right
# operand.
FP8_WEIGHTS_LEFT = True
SCALE_BLOCK = 128
# Programmatic dependent launch of the path's five launches (grouping, gate/up, down, sum) on
# sm_90+: 0 off; 1 each launch may be placed before the one ahead of it ends and waits for it
# at its start (tl.extra.cuda.gdc_wait, before any load: a launch that read earlier outputs
# before it, or ended without it, would break the chain's order); 2 also lets the next launch
# be placed once every gate/up or down program is past its K loop. 2 measured fastest, outputs
# bit for bit the same (docs/benchmarks.md, "Kernel constants").
GDC = 2


# The tallest tile of pairs for FP8 weights (rows_per_tile).
FP8_MAX_ROWS = 16


def rows_per_tile(pairs: int, experts: int, w_fp8: bool = False) -> int:
    """Pairs of one expert per tile: twice the mean load, at least tl.dot's smallest height (16),
    at most 64 (`FP8_MAX_ROWS` for FP8 weights). An expert with more pairs spans several tiles, each
    re-reading its weights; for FP8 tiles taller than 16 rows cost more than the re-reads, where
    bf16 prefers the taller ones (measured on an H200)."""
    mean = -(-pairs // max(1, min(pairs, experts)))
    return min(FP8_MAX_ROWS if w_fp8 else 64, max(16, triton.next_power_of_2(2 * mean)))


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """bf16/fp16 activations with weights in the same dtype or FP8; reduction dims multiples of
    16 (tl.dot's smallest K step), contiguous stacks."""
    if not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (gate_up.dtype == down.dtype and gate_up.dtype in (x.dtype, FP8_DTYPE)):
        return False
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        return False
    return gate_up.shape[2] % 16 == 0 and down.shape[2] % 16 == 0


@triton.jit
def store_h(
    gate,
    up,
    e,
    pairs,
    row_ok,
    col,
    col_ok,
    h_ptr,
    inter,
    limit,
    bias_ptr,
    alpha,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
):
    """A grouped gate/up tile's epilogue: float32 gate and up [ROWS, COLUMNS] of expert e plus
    gpt-oss's biases ([E, 2I], gate half first: reference.ExpertGLU), the activation, and h's
    rows of the tile's pairs."""
    if HAS_BIAS:
        bias_row = bias_ptr + e * 2 * inter
        gate += tl.load(bias_row + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
        up += tl.load(bias_row + inter + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    act = glu_act(gate, up, limit, alpha, HAS_LIMIT, HAS_ALPHA)
    out = h_ptr + pairs.to(tl.int64)[:, None] * inter + col[None, :]
    tl.store(out, act.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def store_y(
    acc, e, pairs, row_ok, col, col_ok, y_ptr, weights_ptr, hidden, bias_ptr, HAS_BIAS: tl.constexpr
):
    """A grouped down tile's epilogue: float32 acc [ROWS, COLUMNS] of expert e plus gpt-oss's bias
    ([E, H], before the routing weight: reference.routed_experts), times each pair's weight,
    into y's rows of the tile's pairs."""
    if HAS_BIAS:
        acc += tl.load(bias_ptr + e * hidden + col, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(weights_ptr + pairs, mask=row_ok, other=0.0).to(tl.float32)
    out = y_ptr + pairs.to(tl.int64)[:, None] * hidden + col[None, :]
    tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _gate_up_kernel(
    x_ptr,
    slots_ptr,
    end_ptr,
    count_ptr,
    w_ptr,
    s_ptr,
    h_ptr,
    num_experts,
    top_k,
    hidden,
    inter,
    s_expert,
    s_row,
    inter_blocks,
    limit,
    bias_ptr,
    alpha,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
    W_FP8: tl.constexpr,
    X_SCALED: tl.constexpr,
    A_FP8: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr = False,
    GDC: tl.constexpr = 0,
    HAS_LIMIT: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False,
    HAS_ALPHA: tl.constexpr = False,
):
    if GDC:  # launched early (programmatic dependent launch): wait for the kernels before
        tl.extra.cuda.gdc_wait()
    expert, pairs, row_ok = tile_rows(slots_ptr, end_ptr, count_ptr, num_experts, ROWS, E_PAD)
    if expert < num_experts:
        e = expert.to(tl.int64)
        col = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        col_ok = col < inter
        k = tl.arange(0, K_BLOCK)
        if WEIGHTS_LEFT:  # FP8 only: the weight tiles the dots' left operand (module docstring)
            # Columns past the last read the last one's weights (same scale block), so no load
            # is masked, nor x's (rows past the tile's pairs read pair 0's row): none is stored.
            load_col = tl.minimum(col, inter - 1).to(tl.int64)
            gate_rows = w_ptr + e * 2 * inter * hidden + load_col[:, None] * hidden + k[None, :]
        else:
            gate_rows = w_ptr + e * 2 * inter * hidden + col.to(tl.int64)[:, None] * hidden
        up_rows = gate_rows + inter * hidden
        # COLUMNS divides 128: the tile's rows share a scale row of each half's grid.
        gate_scales = s_ptr + e * s_expert + (tl.program_id(1) * COLUMNS // 128) * s_row
        up_scales = gate_scales + inter_blocks * s_row
        x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * hidden
        if WEIGHTS_LEFT:
            gate = tl.zeros((COLUMNS, ROWS), dtype=tl.float32)
            up = tl.zeros((COLUMNS, ROWS), dtype=tl.float32)
            for k0 in range(0, hidden, K_BLOCK):
                xo, rs = as_operand(tl.load(x_rows + k0 + k[None, :]), X_SCALED, A_FP8)
                gate = block_dot_left(
                    xo,
                    rs,
                    tl.load(gate_rows + k0),
                    tl.load(gate_scales + k0 // 128),
                    gate,
                    X_SCALED,
                )
                up = block_dot_left(
                    xo, rs, tl.load(up_rows + k0), tl.load(up_scales + k0 // 128), up, X_SCALED
                )
            gate = tl.trans(gate)
            up = tl.trans(up)
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
                W_FP8,
                X_SCALED,
                A_FP8,
                ROWS,
                COLUMNS,
                K_BLOCK,
            )
        if GDC == 2:  # the next launch may place its programs while these store
            tl.extra.cuda.gdc_launch_dependents()
        store_h(
            gate,
            up,
            e,
            pairs,
            row_ok,
            col,
            col_ok,
            h_ptr,
            inter,
            limit,
            bias_ptr,
            alpha,
            HAS_LIMIT,
            HAS_BIAS,
            HAS_ALPHA,
        )


@triton.jit
def _down_kernel(
    h_ptr,
    slots_ptr,
    end_ptr,
    count_ptr,
    weights_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    num_experts,
    hidden,
    inter,
    s_expert,
    s_row,
    bias_ptr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    E_PAD: tl.constexpr,
    W_FP8: tl.constexpr,
    X_SCALED: tl.constexpr,
    A_FP8: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr = False,
    GDC: tl.constexpr = 0,
    HAS_BIAS: tl.constexpr = False,
):
    if GDC:
        tl.extra.cuda.gdc_wait()
    expert, pairs, row_ok = tile_rows(slots_ptr, end_ptr, count_ptr, num_experts, ROWS, E_PAD)
    if expert < num_experts:
        e = expert.to(tl.int64)
        col = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        col_ok = col < hidden
        k = tl.arange(0, K_BLOCK)
        scales = s_ptr + e * s_expert + (tl.program_id(1) * COLUMNS // 128) * s_row
        h_rows = h_ptr + pairs.to(tl.int64)[:, None] * inter
        if WEIGHTS_LEFT:  # as in gate/up: no masked load
            load_col = tl.minimum(col, hidden - 1).to(tl.int64)
            down_rows = w_ptr + e * hidden * inter + load_col[:, None] * inter + k[None, :]
            if COLUMNS > 128:  # a tile of several scale blocks' rows, each row its block's
                scales = s_ptr + e * s_expert + (load_col // 128)[:, None] * s_row
        else:
            down_rows = w_ptr + e * hidden * inter + col.to(tl.int64)[:, None] * inter
        acc = down_tile(
            h_rows,
            row_ok,
            down_rows,
            col_ok,
            scales,
            inter,
            k,
            W_FP8,
            X_SCALED,
            A_FP8,
            WEIGHTS_LEFT,
            ROWS,
            COLUMNS,
            K_BLOCK,
        )
        if GDC == 2:
            tl.extra.cuda.gdc_launch_dependents()
        store_y(acc, e, pairs, row_ok, col, col_ok, y_ptr, weights_ptr, hidden, bias_ptr, HAS_BIAS)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    a8: bool | None = None,
    weights_left: bool | None = None,
    launch: tuple[int, int, int, int] | None = None,
    limit: float | None = None,
    max_pairs: int | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """Same contract as `reference.moe_experts` (ids -1 go to no expert; `limit`: the gate and
    up clamps of DeepSeek-V4's swiglu_limit and gpt-oss; `glu`: gpt-oss's biases, contiguous,
    and gain). x [rows, hidden];
    `scales`: (gate_up_scale_inv, down_scale_inv) when the stacks are FP8; `a8`: quantize x and
    h per row in groups of 128 too (w8a8; None: `triton_fp8.W8A8_EXPERTS`); `weights_left`:
    FP8 weights as the dots' left operand (None: `FP8_WEIGHTS_LEFT`); `launch`: (gate/up columns,
    down columns, warps, stages) (None: `FP8_COLUMNS` or `COLUMNS`); `max_pairs`: pairs a
    launch takes (None: `GROUPED_MAX_PAIRS`), more run in row slices (h and y, [pairs, inter]
    and float32 [pairs, hidden], are its scratch). Check `supports`."""
    rows, top_k = topk_ids.shape
    pairs = rows * top_k
    experts, hidden, inter = gate_up.shape[0], gate_up.shape[2], down.shape[2]
    if pairs == 0 or experts == 0:
        return torch.zeros_like(x)
    max_pairs = GROUPED_MAX_PAIRS if max_pairs is None else max_pairs
    if pairs > max_pairs:
        # Long prefill chunks (FP8 experts take this path at any count): slices of rows, so
        # that h and y (float32 [pairs, hidden]) stay bounded; compute-bound there, so reading
        # the experts once per slice costs little.
        def run(chunk: slice) -> torch.Tensor:
            return moe_experts(
                x[chunk],
                topk_ids[chunk],
                topk_weights[chunk],
                gate_up,
                down,
                scales,
                a8,
                weights_left,
                launch,
                limit,
                max_pairs,
                glu,
            )

        return in_row_chunks(topk_ids, max_pairs, run)
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    glu = glu or ExpertGLU()
    w_fp8 = scales is not None
    tile = rows_per_tile(pairs, experts, w_fp8)
    gdc = GDC if x.is_cuda and torch.cuda.get_device_capability(x.device)[0] >= 9 else 0
    groups = assign(ids, experts, tile, gdc)
    if w_fp8:
        gate_up_scale, down_scale = (s.contiguous() for s in scales)
    else:  # never read: the FP8 branches compile out
        gate_up_scale = down_scale = weights
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    gate_up_columns, down_columns, warps, stages = launch or (FP8_COLUMNS if w_fp8 else COLUMNS)
    left = w_fp8 and (FP8_WEIGHTS_LEFT if weights_left is None else weights_left)
    if w_fp8 and not left:  # weights right: the tile in one scale block (triton_fp8.block_dot)
        down_columns = min(down_columns, SCALE_BLOCK)
    # An FP8 tile lies in one scale block, or (down, weights left) spans whole ones.
    assert SCALE_BLOCK % gate_up_columns == 0
    assert SCALE_BLOCK % down_columns == 0 or down_columns % SCALE_BLOCK == 0
    e_pad = max(16, triton.next_power_of_2(experts))
    # FP8 weights: FP8 dots on rows quantized per 128-group (a8), or fp16 dots on bf16 rows
    # scaled into fp16 (triton_fp8.as_operand), per kernel by its K step.
    a8 = triton_fp8.W8A8_EXPERTS if a8 is None else a8
    up_step, down_step = _k_block(hidden), _k_block(inter)
    common = dict(
        ROWS=tile,
        E_PAD=e_pad,
        W_FP8=w_fp8,
        WEIGHTS_LEFT=left,
        num_warps=warps,
        num_stages=stages,
        GDC=gdc,
        launch_pdl=gdc > 0,
    )
    g_strides = (gate_up_scale.stride(0), gate_up_scale.stride(1)) if w_fp8 else (0, 0)
    d_strides = (down_scale.stride(0), down_scale.stride(1)) if w_fp8 else (0, 0)
    _gate_up_kernel[(groups.tiles, triton.cdiv(inter, gate_up_columns))](
        x,
        groups.slots,
        groups.expert_end,
        groups.expert_count,
        gate_up,
        gate_up_scale,
        h,
        experts,
        top_k,
        hidden,
        inter,
        *g_strides,
        triton.cdiv(inter, SCALE_BLOCK),
        0.0 if limit is None else float(limit),
        x if glu.gate_up_bias is None else glu.gate_up_bias,  # never read without a bias
        1.0 if glu.alpha is None else float(glu.alpha),
        COLUMNS=gate_up_columns,
        K_BLOCK=up_step,
        HAS_LIMIT=limit is not None,
        HAS_BIAS=glu.gate_up_bias is not None,
        HAS_ALPHA=glu.alpha is not None,
        **common,
        **triton_fp8.operand_modes(a8, up_step, x.dtype, w_fp8),
    )
    _down_kernel[(groups.tiles, triton.cdiv(hidden, down_columns))](
        h,
        groups.slots,
        groups.expert_end,
        groups.expert_count,
        weights,
        down,
        down_scale,
        y,
        experts,
        hidden,
        inter,
        *d_strides,
        x if glu.down_bias is None else glu.down_bias,  # never read without a bias
        COLUMNS=down_columns,
        K_BLOCK=down_step,
        HAS_BIAS=glu.down_bias is not None,
        **common,
        **triton_fp8.operand_modes(a8, down_step, x.dtype, w_fp8),
    )
    return sum_pairs(y, ids, out, experts, gdc)
