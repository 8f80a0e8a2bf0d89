"""Routed experts straight from FP4 weights (DeepSeek-V4's e2m1 + ue8m0 format, kernels/fp4.py),
as three Triton launches with no host sync.

The H200 (sm_90) has no FP4 tensor cores, so nothing here is an FP4 matmul: each program loads
its expert's packed bytes and their ue8m0 scales, unpacks the two e2m1 nibbles of every byte and
multiplies them by 2^(scale - 127) in registers (127: the ue8m0 bias, kernels/fp4.E8M0_BIAS),
converts the products to x's dtype (exact: an e2m1 value times a power of two has at most two
significant bits) and feeds them to tl.dot in bf16/fp16 with an fp32 accumulator. The weights
never exist in bf16 in memory, so a decode step reads half a byte per weight (plus one scale
byte per 32), a quarter of bf16's traffic.

Packed byte j of a row holds inputs 2j (low nibble) and 2j + 1 (high). Rather than interleave
the two nibble tiles back into input order, each K step takes two dots: x's even columns against
the low nibbles and x's odd columns against the high ones.

The routing is resolved in the kernels as in triton_moe.py (whose pair helpers and final sum
these reuse): each program owns one expert, finds that expert's (token, expert) pairs in the
pair list it holds in registers, and streams the expert's weight tile once for all of them. That
list is bounded by `MAX_PAIRS`; larger batches (prefill) run in row chunks of at most that many
pairs, each chunk the same three launches, so a graph capture of any batch works.

1. gate/up: h[pair] = silu(min(g, limit)) * clamp(u, -limit, limit), g, u = x W_gate^T, x W_up^T.
2. down:    y[pair] = weight[pair] * (h[pair] W_down^T), fp32.
3. sum:     out[row] = sum of the row's top_k y rows, cast to x's dtype.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.fp4 import FP4_BLOCK
from afdserve.kernels.triton_moe import (
    SUM_COLUMNS,
    _expert_pairs,
    _rows_per_tile,
    _sum_kernel,
    _tile_pairs,
    _tiles,
)

# Pairs one launch takes (its pair list is held in registers); a larger batch runs in chunks.
MAX_PAIRS = 1024


def _k_block(dim: int) -> int:
    """Inputs per K step: the widest that divides `dim`, at least one scale group (32), whose
    packed half (16 bytes) is tl.dot's smallest K."""
    return next(b for b in (128, 64, 32) if dim % b == 0)


def supports(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
) -> bool:
    """CUDA bf16/fp16 rows, uint8 packed weights and scales, contiguous, reduction dims
    multiples of 32 (one ue8m0 scale per 32 inputs)."""
    tensors = (*gate_up, *down)
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    if not all(t.dtype == torch.uint8 and t.is_contiguous() for t in tensors):
        return False
    hidden, inter = 2 * gate_up[0].shape[2], 2 * down[0].shape[2]
    return hidden % FP4_BLOCK == 0 and inter % FP4_BLOCK == 0 and x.shape[-1] == hidden


@triton.jit
def _e2m1(code):
    """int32 e2m1 codes (0..15) -> their float32 values: sign bit 3, exponent bits 2-1 (bias 1),
    mantissa bit 0; exponent 0 is the subnormal 0.5 * mantissa."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    normal = tl.exp2((exponent - 1).to(tl.float32)) * (1.0 + 0.5 * mantissa)
    value = tl.where(exponent == 0, 0.5 * mantissa, normal)
    return tl.where((code & 8) != 0, -value, value)


@triton.jit
def _fp4_tile(w_rows, s_rows, col_ok, k0, j, dtype: tl.constexpr):
    """One K step of a weight tile: rows at `w_rows` / `s_rows` ([COLUMNS, 1] pointers to packed
    bytes and scales), packed columns k0 / 2 + j -> (weights of inputs k0 + 2j, of k0 + 2j + 1),
    each [COLUMNS, K / 2] in `dtype`."""
    packed = tl.load(w_rows + k0 // 2 + j[None, :], mask=col_ok[:, None], other=0).to(tl.int32)
    scale = tl.load(s_rows + k0 // 32 + (j // 16)[None, :], mask=col_ok[:, None], other=127).to(
        tl.int32
    )
    factor = tl.exp2((scale - 127).to(tl.float32))
    even = (_e2m1(packed & 15) * factor).to(dtype)
    odd = (_e2m1(packed >> 4) * factor).to(dtype)
    return even, odd


@triton.jit
def _gate_up_kernel(
    x_ptr, ids_ptr, w_ptr, s_ptr, h_ptr, num_pairs, top_k, hidden, inter, limit,
    HAS_LIMIT: tl.constexpr, PAIRS_PAD: tl.constexpr, BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr, COLUMNS: tl.constexpr, K_BLOCK: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(1)
    expert, pair, mine, rank, count = _expert_pairs(ids_ptr, num_pairs, slot, PAIRS_PAD, BY_EXPERT)
    col = tl.program_id(0) * COLUMNS + tl.arange(0, COLUMNS)
    col_ok = col < inter
    j = tl.arange(0, K_BLOCK // 2)
    dtype = x_ptr.dtype.element_ty
    # [E, 2I, H / 2] bytes and [E, 2I, H / 32] scales: gate rows first, then up rows.
    gate_w = w_ptr + expert * 2 * inter * (hidden // 2) + col[:, None] * (hidden // 2)
    up_w = gate_w + inter * (hidden // 2)
    gate_s = s_ptr + expert * 2 * inter * (hidden // 32) + col[:, None] * (hidden // 32)
    up_s = gate_s + inter * (hidden // 32)
    for first in range(0, count, ROWS):
        rows, row_ok = _tile_pairs(pair, mine, rank, first, count, ROWS)
        x_rows = x_ptr + (rows // top_k)[:, None] * hidden  # [ROWS, 1]
        gate = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        up = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        for k0 in range(0, hidden, K_BLOCK):
            x_even = tl.load(x_rows + k0 + 2 * j[None, :], mask=row_ok[:, None], other=0.0)
            x_odd = tl.load(x_rows + k0 + 2 * j[None, :] + 1, mask=row_ok[:, None], other=0.0)
            g_even, g_odd = _fp4_tile(gate_w, gate_s, col_ok, k0, j, dtype)
            u_even, u_odd = _fp4_tile(up_w, up_s, col_ok, k0, j, dtype)
            gate = tl.dot(x_even, tl.trans(g_even), gate)
            gate = tl.dot(x_odd, tl.trans(g_odd), gate)
            up = tl.dot(x_even, tl.trans(u_even), up)
            up = tl.dot(x_odd, tl.trans(u_odd), up)
        if HAS_LIMIT:
            gate = tl.minimum(gate, limit)
            up = tl.minimum(tl.maximum(up, -limit), limit)
        act = gate / (1.0 + tl.exp(-gate)) * up
        out = h_ptr + rows[:, None] * inter + col[None, :]
        tl.store(out, act.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit
def _down_kernel(
    h_ptr, ids_ptr, weights_ptr, w_ptr, s_ptr, y_ptr, num_pairs, hidden, inter,
    PAIRS_PAD: tl.constexpr, BY_EXPERT: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
):  # fmt: skip
    slot = tl.program_id(1)
    expert, pair, mine, rank, count = _expert_pairs(ids_ptr, num_pairs, slot, PAIRS_PAD, BY_EXPERT)
    col = tl.program_id(0) * COLUMNS + tl.arange(0, COLUMNS)
    col_ok = col < hidden
    j = tl.arange(0, K_BLOCK // 2)
    dtype = h_ptr.dtype.element_ty
    # [E, H, I / 2] bytes and [E, H, I / 32] scales.
    down_w = w_ptr + expert * hidden * (inter // 2) + col[:, None] * (inter // 2)
    down_s = s_ptr + expert * hidden * (inter // 32) + col[:, None] * (inter // 32)
    for first in range(0, count, ROWS):
        rows, row_ok = _tile_pairs(pair, mine, rank, first, count, ROWS)
        h_rows = h_ptr + rows[:, None] * inter
        acc = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        for k0 in range(0, inter, K_BLOCK):
            h_even = tl.load(h_rows + k0 + 2 * j[None, :], mask=row_ok[:, None], other=0.0)
            h_odd = tl.load(h_rows + k0 + 2 * j[None, :] + 1, mask=row_ok[:, None], other=0.0)
            w_even, w_odd = _fp4_tile(down_w, down_s, col_ok, k0, j, dtype)
            acc = tl.dot(h_even, tl.trans(w_even), acc)
            acc = tl.dot(h_odd, tl.trans(w_odd), acc)
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        out = y_ptr + rows[:, None] * hidden + col[None, :]
        tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


def _launch(
    x: torch.Tensor,
    ids: torch.Tensor,
    weights: torch.Tensor,
    top_k: int,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None,
) -> torch.Tensor:
    """One chunk: x [rows, hidden], ids / weights [rows * top_k] -> [rows, hidden]."""
    rows, hidden = x.shape
    pairs = ids.shape[0]
    inter = 2 * down[0].shape[2]
    experts = gate_up[0].shape[0]
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    out = torch.empty_like(x)
    routing = dict(
        PAIRS_PAD=max(64, triton.next_power_of_2(pairs)),
        BY_EXPERT=pairs > experts,
        ROWS=_rows_per_tile(pairs, experts),
    )
    slots = min(pairs, experts)
    gate_up_columns, down_columns, warps, stages = _tiles(pairs)
    _gate_up_kernel[(triton.cdiv(inter, gate_up_columns), slots)](
        x, ids, gate_up[0], gate_up[1], h, pairs, top_k, hidden, inter,
        0.0 if limit is None else float(limit), HAS_LIMIT=limit is not None, **routing,
        COLUMNS=gate_up_columns, K_BLOCK=_k_block(hidden), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _down_kernel[(triton.cdiv(hidden, down_columns), slots)](
        h, ids, weights, down[0], down[1], y, pairs, hidden, inter, **routing,
        COLUMNS=down_columns, K_BLOCK=_k_block(inter), num_warps=warps, num_stages=stages,
    )  # fmt: skip
    _sum_kernel[(rows, triton.cdiv(hidden, SUM_COLUMNS))](
        y, out, top_k, hidden, COLUMNS=SUM_COLUMNS, num_warps=4
    )
    return out


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None = None,
) -> torch.Tensor:
    """Same contract as `fp4.moe_experts_fp4`; check `supports` first. Ids must be in
    [0, experts): `ops.moe_experts_fp4` turns -1 (no expert) into expert 0 with weight 0."""
    rows, top_k = topk_ids.shape
    if rows == 0:
        return torch.zeros_like(x)
    x = x.contiguous()
    ids = topk_ids.reshape(-1).contiguous()  # [pairs], pair p = row * top_k + j
    weights = topk_weights.reshape(-1).contiguous()
    step = max(1, MAX_PAIRS // top_k)  # rows per launch
    chunks = [
        _launch(
            x[r : r + step],
            ids[r * top_k : (r + step) * top_k],
            weights[r * top_k : (r + step) * top_k],
            top_k,
            gate_up,
            down,
            limit,
        )
        for r in range(0, rows, step)
    ]
    return chunks[0] if len(chunks) == 1 else torch.cat(chunks)
