"""Routed experts for decode batches as three Triton launches, with no host sync.

A decode step routes few (token, expert) pairs, so a grouped GEMM's sort / scatter / gather and
its per-group tiles cost more than reading the touched experts' weights. Here the routing is
resolved inside the kernels from the pair list held in registers (moe/routing.py): each program
owns one expert, collects its pairs by a prefix sum and streams the expert's weight tile once for
all of them. The list lives in every program's registers, hence small batches only (`MAX_PAIRS`).

1. gate/up: h[pair] = silu(x W_gate^T) * (x W_up^T) for one tile of the intermediate columns
   (gpt-oss, a clamp and `ExpertGLU`: biases, then (u' + 1) * g' * sigmoid(alpha g')).
2. down:    y[pair] = weight[pair] * (h[pair] W_down^T (+ its bias)) for one tile of the hidden
   columns, fp32.
3. sum:     out[row] = sum of the row's routed y rows (pairs of id -1 skipped), in x's dtype.

Weights as afdserve stacks them: gate_up [E, 2I, H] (gate rows, then up), down [E, H, I].
Products accumulate in fp32; h is stored in x's dtype, as the grouped GEMM path stores it.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe.routing import decode_launch, program_pairs, tile_pairs
from afdserve.kernels.reference.layers import ExpertGLU

# Pairs (rows * top_k) up to which `ops.moe_experts` picks this path over the sort-free grouped
# GEMM: where the two took the same time on an H200 (docs/benchmarks.md, "Kernel constants").
MAX_PAIRS = 512

# Tile shapes by pair count, each row used up to its first field: (pairs, intermediate columns
# per gate/up program, hidden columns per down program, warps, pipeline stages). Timed on an H200
# for Qwen3-30B-A3B's experts. Wider tiles mean fewer programs, each paying the routing prologue
# once; narrower ones spread the few experts of a small batch over more SMs.
TILES = ((8, 32, 64, 4, 4), (64, 32, 64, 2, 4), (1024, 64, 64, 4, 4))
SUM_COLUMNS = 512


def _tiles(pairs: int) -> tuple[int, int, int, int]:
    return next((row[1:] for row in TILES if pairs <= row[0]), TILES[-1][1:])


def _k_block(dim: int) -> int:
    """The widest reduction step that divides `dim`, so the inner loops need no K mask."""
    return next(b for b in (128, 64, 32, 16) if dim % b == 0)


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """Float weights whose reduction dims are multiples of 16 (tl.dot's smallest K step)."""
    if not (x.is_cuda and x.dtype == gate_up.dtype == down.dtype):
        return False
    if x.dtype not in (torch.bfloat16, torch.float16):
        return False
    if not (gate_up.is_contiguous() and down.is_contiguous()):
        return False
    hidden, inter = gate_up.shape[2], down.shape[2]
    return hidden % 16 == 0 and inter % 16 == 0


@triton.jit
def glu_act(gate, up, limit, alpha, HAS_LIMIT: tl.constexpr, HAS_ALPHA: tl.constexpr):
    """Every expert kernel's activation on float32 gate and up tiles (reference.swiglu): the clamps
    of DeepSeek-V4's swiglu_limit and gpt-oss (`HAS_LIMIT`), then silu(gate) * up, or gpt-oss's
    (up + 1) * gate * sigmoid(alpha gate) (`HAS_ALPHA`)."""
    if HAS_LIMIT:
        gate = tl.minimum(gate, limit)
        up = tl.minimum(tl.maximum(up, -limit), limit)
    if HAS_ALPHA:
        act = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
    else:
        act = gate / (1.0 + tl.exp(-gate)) * up
    return act


@triton.jit
def _gate_up_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    h_ptr,
    num_pairs,
    top_k,
    hidden,
    inter,
    limit,
    bias_ptr,
    alpha,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    HAS_LIMIT: tl.constexpr = False,
    HAS_BIAS: tl.constexpr = False,
    HAS_ALPHA: tl.constexpr = False,
):
    expert, pair, mine, rank, count, col, col_ok = program_pairs(
        ids_ptr, num_pairs, inter, PAIRS_PAD, BY_EXPERT, COLUMNS
    )
    k = tl.arange(0, K_BLOCK)
    gate_rows = w_ptr + expert * 2 * inter * hidden + col[:, None] * hidden  # [COLUMNS, 1]
    up_rows = gate_rows + inter * hidden
    if HAS_BIAS:  # [E, 2I], gate half first; an expert slot without pairs reads expert 0's
        bias_row = bias_ptr + tl.maximum(expert, 0) * 2 * inter
        gate_bias = tl.load(bias_row + col, mask=col_ok, other=0.0).to(tl.float32)
        up_bias = tl.load(bias_row + inter + col, mask=col_ok, other=0.0).to(tl.float32)
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs(pair, mine, rank, first, count, ROWS)
        x_rows = x_ptr + (rows // top_k)[:, None] * hidden  # [ROWS, 1]
        gate = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        up = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        for k0 in range(0, hidden, K_BLOCK):
            xs = tl.load(x_rows + k0 + k[None, :], mask=row_ok[:, None], other=0.0)
            wg = tl.load(gate_rows + k0 + k[None, :], mask=col_ok[:, None], other=0.0)
            wu = tl.load(up_rows + k0 + k[None, :], mask=col_ok[:, None], other=0.0)
            gate = tl.dot(xs, tl.trans(wg), gate)
            up = tl.dot(xs, tl.trans(wu), up)
        if HAS_BIAS:
            gate += gate_bias[None, :]
            up += up_bias[None, :]
        act = glu_act(gate, up, limit, alpha, HAS_LIMIT, HAS_ALPHA)
        out = h_ptr + rows[:, None] * inter + col[None, :]
        tl.store(out, act.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr,
    ids_ptr,
    weights_ptr,
    w_ptr,
    y_ptr,
    num_pairs,
    hidden,
    inter,
    bias_ptr,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr = False,
):
    expert, pair, mine, rank, count, col, col_ok = program_pairs(
        ids_ptr, num_pairs, hidden, PAIRS_PAD, BY_EXPERT, COLUMNS
    )
    k = tl.arange(0, K_BLOCK)
    down_rows = w_ptr + expert * hidden * inter + col[:, None] * inter  # [COLUMNS, 1]
    if HAS_BIAS:  # [E, H]; an expert slot without pairs reads expert 0's
        bias = tl.load(bias_ptr + tl.maximum(expert, 0) * hidden + col, mask=col_ok, other=0.0)
        bias = bias.to(tl.float32)
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs(pair, mine, rank, first, count, ROWS)
        h_rows = h_ptr + rows[:, None] * inter
        acc = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        for k0 in range(0, inter, K_BLOCK):
            hs = tl.load(h_rows + k0 + k[None, :], mask=row_ok[:, None], other=0.0)
            wd = tl.load(down_rows + k0 + k[None, :], mask=col_ok[:, None], other=0.0)
            acc = tl.dot(hs, tl.trans(wd), acc)
        if HAS_BIAS:
            acc += bias[None, :]
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        out = y_ptr + rows[:, None] * hidden + col[None, :]
        tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _sum_kernel(
    y_ptr,
    ids_ptr,
    out_ptr,
    slots_ptr,
    weights_ptr,
    num_experts,
    top_k,
    hidden,
    TOP_K_PAD: tl.constexpr,
    COLUMNS: tl.constexpr,
    GDC: tl.constexpr = 0,
    HAS_SLOTS: tl.constexpr = False,
    HAS_WEIGHTS: tl.constexpr = False,
):
    """out[row] = the sum of the row's y rows, skipping pairs routed to no expert here (id
    outside [0, num_experts): never written). Every expert path's last launch: the row's top_k
    loads are one [TOP_K_PAD, COLUMNS] tile, issued together rather than one after another, and
    reduced in tl.sum's fixed tree order (the same bits every run and on every rank).
    `HAS_SLOTS`: a pair's y row is slots[pair] (y grouped by expert); `HAS_WEIGHTS`: each y row
    is scaled by its pair's routing weight here, in float32."""
    if GDC:  # launched early (programmatic dependent launch): wait for the kernels before
        tl.extra.cuda.gdc_wait()
    row = tl.program_id(0)
    col = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
    j = tl.arange(0, TOP_K_PAD)
    pair = row.to(tl.int64) * top_k + j
    expert = tl.load(ids_ptr + pair, mask=j < top_k, other=-1)
    routed = (j < top_k) & (expert >= 0) & (expert < num_experts)
    ok = col < hidden
    source = pair
    if HAS_SLOTS:
        source = tl.load(slots_ptr + pair, mask=routed, other=0).to(tl.int64)
    y = tl.load(
        y_ptr + source[:, None] * hidden + col[None, :],
        mask=routed[:, None] & ok[None, :],
        other=0.0,
    ).to(tl.float32)
    if HAS_WEIGHTS:
        y *= tl.load(weights_ptr + pair, mask=routed, other=0.0).to(tl.float32)[:, None]
    out = tl.sum(y, axis=0)
    tl.store(out_ptr + row.to(tl.int64) * hidden + col, out.to(out_ptr.dtype.element_ty), mask=ok)


def sum_pairs(
    y: torch.Tensor,
    ids: torch.Tensor,
    out: torch.Tensor,
    experts: int,
    gdc: int = 0,
    slots: torch.Tensor | None = None,
    weights: torch.Tensor | None = None,
    columns: int = SUM_COLUMNS,
    warps: int = 4,
) -> torch.Tensor:
    """`_sum_kernel` over out [rows, hidden] from y [rows * top_k, hidden] float32 and the flat
    ids [rows * top_k]; or, with `slots` [rows * top_k], pair p's row of y is slots[p] (y in any
    float dtype, rows no routed pair names left unread), and with `weights` [rows * top_k] each
    row is scaled by its pair's weight before the sum. `columns`, `warps`: a program's tile."""
    rows, hidden = out.shape
    top_k = ids.numel() // max(1, rows)
    _sum_kernel[(rows, triton.cdiv(hidden, columns))](
        y,
        ids,
        out,
        ids if slots is None else slots,  # never read without them
        ids if weights is None else weights,
        experts,
        top_k,
        hidden,
        TOP_K_PAD=max(2, triton.next_power_of_2(top_k)),
        COLUMNS=columns,
        GDC=gdc,
        HAS_SLOTS=slots is not None,
        HAS_WEIGHTS=weights is not None,
        num_warps=warps,
        launch_pdl=gdc > 0,
    )
    return out


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
    limit: float | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """Same contract as `reference.moe_experts` (ids -1 go to no expert). x [rows, hidden];
    check `supports` first. `limit`, `glu`: gpt-oss's clamp, biases (contiguous) and gain."""
    glu = glu or ExpertGLU()
    rows, top_k = topk_ids.shape
    pairs = rows * top_k
    hidden, inter = gate_up.shape[2], down.shape[2]
    if pairs == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    experts = gate_up.shape[0]
    launch = decode_launch(x, topk_ids, topk_weights, experts, inter)
    gate_up_columns, down_columns, warps, stages = _tiles(pairs)
    _gate_up_kernel[(triton.cdiv(inter, gate_up_columns), launch.slots)](
        x,
        launch.ids,
        gate_up,
        launch.h,
        pairs,
        top_k,
        hidden,
        inter,
        0.0 if limit is None else float(limit),
        x if glu.gate_up_bias is None else glu.gate_up_bias,  # unused placeholder without
        1.0 if glu.alpha is None else float(glu.alpha),
        **launch.routing,
        COLUMNS=gate_up_columns,
        K_BLOCK=_k_block(hidden),
        HAS_LIMIT=limit is not None,
        HAS_BIAS=glu.gate_up_bias is not None,
        HAS_ALPHA=glu.alpha is not None,
        num_warps=warps,
        num_stages=stages,
    )
    _down_kernel[(triton.cdiv(hidden, down_columns), launch.slots)](
        launch.h,
        launch.ids,
        launch.weights,
        down,
        launch.y,
        pairs,
        hidden,
        inter,
        x if glu.down_bias is None else glu.down_bias,  # unused placeholder without
        **launch.routing,
        COLUMNS=down_columns,
        K_BLOCK=_k_block(inter),
        HAS_BIAS=glu.down_bias is not None,
        num_warps=warps,
        num_stages=stages,
    )
    return sum_pairs(launch.y, launch.ids, launch.out, experts)
