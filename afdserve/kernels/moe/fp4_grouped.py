"""FP4 routed experts for prefill-sized batches, over align.py's tiles of pairs grouped by expert
(grouped.py's assignment), in one of two ways:

- **in registers** (`DIRECT`): grouped.py's tiling with fp4_decode.py's K loop: each program
  decodes its expert's weight tile in registers (`fp4_decode.fp4_reduce`'s bit moves) for a tile
  of up to 64 of that expert's pairs, so a weight is decoded once per tile of rows and no bf16
  copy exists. The decode kernels (fp4_decode.py) rank a launch's pair list in every program
  and take at most `fp4_decode.MAX_PAIRS` pairs a launch: a longer batch ran in row chunks of
  85 rows at DeepSeek-V4-Flash's top-6, each decoding again every expert it touched (~220 of
  256).
- **through a bf16 copy**: the experts dequantized to x's dtype a group of `GROUP_BYTES` at a
  time, then grouped.py's GEMM: every expert written and read back in bf16 before any dot.

The in-register way is faster at every batch `tools/fp4_moe_bench.py --prefill` measured
(docs/benchmarks.md, "FP4 experts decoded in registers for prefill"): a 1024-token prefill decodes
each weight once and an 8192-token one three times, where the copy moves four bytes a weight
first. gpt-oss's MXFP4 experts (the same format) take both ways, with their biases and gain. No
host sync: graph capturable.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe import fp4_decode, grouped
from afdserve.kernels.moe.align import assign
from afdserve.kernels.moe.decode import sum_pairs
from afdserve.kernels.moe.fp4_decode import fp4_reduce
from afdserve.kernels.moe.grouped import store_h, store_y
from afdserve.kernels.moe.routing import in_row_chunks, tile_rows
from afdserve.kernels.reference.layers import ExpertGLU

# The bf16 (fp16) copy of one group of experts at most, in bytes: scratch memory against the
# number of grouped launches (one set per group).
GROUP_BYTES = 1 << 30
# h and y of the grouped GEMM (grouped.moe_experts' scratch) at most, in bytes: more pairs run
# in row slices, each reading the group's copy again.
SLICE_BYTES = 1 << 30


def _slice_pairs(hidden: int, inter: int) -> int:
    """Pairs whose h ([pairs, inter] in x's bf16/fp16) and y ([pairs, hidden] float32) fit
    SLICE_BYTES."""
    return max(1, SLICE_BYTES // (2 * inter + 4 * hidden))


# Pairs from which `ops.moe_experts_fp4` takes this path: where the decode kernels would run in
# row chunks, each decoding the touched experts again (up to there both are one pass over them).
MIN_PAIRS = fp4_decode.MAX_PAIRS + 1
BLOCK = 1024  # packed bytes per dequantizing program
# Whether this path decodes the weights in registers (module docstring) rather than copying them.
DIRECT = True


class DirectLaunch(NamedTuple):
    """The in-register way's launch (a plain tuple of its first five fields or all six will do)."""

    gate_up_columns: int  # intermediate columns a program: its gate and up rows, one tile of 2x
    down_columns: int  # hidden columns a down program
    k_block: int
    warps: int
    stages: int
    one_dot: bool = False  # one dot a K step: `fp4_decode.Tiles.one_dot`


# fp4_decode.TILES' shape, chosen by the bench's `--direct-launches` sweep (one dot: 5% at 1024
# rows, even at 8192).
DIRECT_LAUNCH = DirectLaunch(64, 128, 128, 4, 3, one_dot=True)


def supports(x: torch.Tensor, gate_up: tuple, down: tuple) -> bool:
    """What grouped.py runs (CUDA bf16/fp16 rows; the dims multiples of 16) over uint8 FP4
    pairs whose rows hold whole scale groups (inputs a multiple of 32)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    tensors = (*gate_up, *down)
    if not all(t.dtype == torch.uint8 and t.is_contiguous() for t in tensors):
        return False
    hidden, inter = 2 * gate_up[0].shape[2], 2 * down[0].shape[2]
    return hidden % 32 == 0 and inter % 32 == 0 and x.shape[-1] == hidden


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32: sign (bit 3), exponent (bits 2-1, bias 1) and
    mantissa (bit 0); exponent 0 is the subnormal 0.5 m. Powers of two built from their bits."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    power = ((exponent + 126) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 1)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, power * (1.0 + 0.5 * mantissa))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, num_bytes, BLOCK: tl.constexpr):
    """Bytes [i, i + BLOCK) of the flat packed stack: byte b holds inputs 2b (low nibble) and
    2b + 1; its scale is byte b // 16 of the flat scales (a row holds whole groups of 32)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_bytes
    b = tl.load(packed_ptr + offs, mask=ok, other=0).to(tl.int32)
    s = tl.load(scale_ptr + offs // 16, mask=ok, other=127).to(tl.int32)
    # 2^(s - 127) from its bits; s = 0 is 2^-127, a float32 subnormal (bit 22 alone).
    factor = tl.where(s == 0, (1 << 22), s << 23).to(tl.float32, bitcast=True)
    out = out_ptr + 2 * offs
    tl.store(out, (_e2m1(b & 15) * factor).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + 1, (_e2m1(b >> 4) * factor).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`fp4.dequantize_fp4(packed, scale, out.dtype)` into `out` (contiguous, packed's shape with
    the last dim doubled), bit for bit: the float32 product is exact, rounded once."""
    n = packed.numel()
    if n:
        _dequantize_kernel[(triton.cdiv(n, BLOCK),)](packed, scale, out, n, BLOCK=BLOCK)
    return out


@triton.jit
def _direct_gate_up_kernel(
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
    w_row,
    s_row,
    limit,
    bias_ptr,
    alpha,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    E_PAD: tl.constexpr,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """h[pair] for a tile of one expert's pairs (tile_rows) and COLUMNS intermediate columns: the
    gate rows of those columns and then their up rows as one weight tile of 2 * COLUMNS rows,
    decoded in registers as the dots' left operand (fp4_decode._gate_up_kernel's tile).
    [E, 2I, H / 8] int32 words and [E, 2I, H / 32] scales; w_row = H / 8, s_row = H / 32."""
    expert, pairs, row_ok = tile_rows(slots_ptr, end_ptr, count_ptr, num_experts, ROWS, E_PAD)
    if expert < num_experts:
        e = expert.to(tl.int64)
        col = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        col_ok = col < inter
        r = tl.arange(0, 2 * COLUMNS)
        # Columns past the last read the last one's bytes and rows past the tile's pairs read
        # pair 0's row (tile_rows), so no load is masked; neither is stored.
        both_col = tl.minimum(tl.program_id(1) * COLUMNS + r % COLUMNS, inter - 1)
        both_row = e * 2 * inter + (r // COLUMNS) * inter + both_col
        both_w = w_ptr + both_row * w_row
        both_s = s_ptr + both_row * s_row
        x_rows = x_ptr + (pairs // top_k).to(tl.int64)[:, None] * hidden
        acc = tl.zeros((2 * COLUMNS, ROWS), dtype=tl.float32)
        acc = fp4_reduce(
            acc, x_rows, both_w, both_s, hidden, ROWS, 2 * COLUMNS, K_BLOCK, TAIL, True, ONE_DOT
        )
        # [2C, ROWS] -> [ROWS, 2, C] -> [ROWS, C, 2] -> gate and up, [ROWS, C] each.
        both = tl.permute(tl.reshape(tl.trans(acc), (ROWS, 2, COLUMNS)), (0, 2, 1))
        gate, up = tl.split(both)
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
def _direct_down_kernel(
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
    w_row,
    s_row,
    bias_ptr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    E_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """y[pair] = weight[pair] * (h[pair] W_down^T (+ its bias)) for a tile of one expert's pairs
    and COLUMNS hidden columns. [E, H, I / 8] int32 words, [E, H, I / 32] scales; w_row = I / 8,
    s_row = I / 32."""
    expert, pairs, row_ok = tile_rows(slots_ptr, end_ptr, count_ptr, num_experts, ROWS, E_PAD)
    if expert < num_experts:
        e = expert.to(tl.int64)
        col = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        col_ok = col < hidden
        load_col = tl.minimum(col, hidden - 1).to(tl.int64)
        down_w = w_ptr + (e * hidden + load_col) * w_row
        down_s = s_ptr + (e * hidden + load_col) * s_row
        h_rows = h_ptr + pairs.to(tl.int64)[:, None] * inter
        acc = tl.zeros((COLUMNS, ROWS), dtype=tl.float32)
        acc = fp4_reduce(
            acc, h_rows, down_w, down_s, inter, ROWS, COLUMNS, K_BLOCK, TAIL, True, ONE_DOT
        )
        acc = tl.trans(acc)
        store_y(acc, e, pairs, row_ok, col, col_ok, y_ptr, weights_ptr, hidden, bias_ptr, HAS_BIAS)


def _direct(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None,
    glu: ExpertGLU,
    launch: DirectLaunch | tuple[int, ...],
) -> torch.Tensor:
    """The in-register way over x [rows, hidden] whose pairs fit the scratch (h and y)."""
    experts, two_inter, half_hidden = gate_up[0].shape
    hidden, inter = 2 * half_hidden, two_inter // 2
    rows, top_k = topk_ids.shape
    pairs = rows * top_k
    ids = topk_ids.reshape(-1).contiguous()
    weights = topk_weights.reshape(-1).contiguous()
    tile = grouped.rows_per_tile(pairs, experts)
    groups = assign(ids, experts, tile)
    h = torch.empty(pairs, inter, dtype=x.dtype, device=x.device)
    y = torch.empty(pairs, hidden, dtype=torch.float32, device=x.device)
    gate_up_columns, down_columns, k_block, warps, stages, one_dot = DirectLaunch(*launch)
    common = dict(ROWS=tile, E_PAD=max(16, triton.next_power_of_2(experts)), ONE_DOT=bool(one_dot))
    options = dict(num_warps=warps, num_stages=stages)
    _direct_gate_up_kernel[(groups.tiles, triton.cdiv(inter, gate_up_columns))](
        x,
        groups.slots,
        groups.expert_end,
        groups.expert_count,
        fp4_decode._words(gate_up[0]),
        gate_up[1],
        h,
        experts,
        top_k,
        hidden,
        inter,
        hidden // 8,
        hidden // 32,
        0.0 if limit is None else float(limit),
        x if glu.gate_up_bias is None else glu.gate_up_bias,  # never read without a bias
        1.0 if glu.alpha is None else float(glu.alpha),
        COLUMNS=gate_up_columns,
        **fp4_decode.k_constants(hidden, k_block),
        HAS_LIMIT=limit is not None,
        HAS_BIAS=glu.gate_up_bias is not None,
        HAS_ALPHA=glu.alpha is not None,
        **common,
        **options,
    )
    _direct_down_kernel[(groups.tiles, triton.cdiv(hidden, down_columns))](
        h,
        groups.slots,
        groups.expert_end,
        groups.expert_count,
        weights,
        fp4_decode._words(down[0]),
        down[1],
        y,
        experts,
        hidden,
        inter,
        inter // 8,
        inter // 32,
        x if glu.down_bias is None else glu.down_bias,  # never read without a bias
        COLUMNS=down_columns,
        **fp4_decode.k_constants(inter, k_block),
        HAS_BIAS=glu.down_bias is not None,
        **common,
        **options,
    )
    return sum_pairs(y, ids, torch.empty_like(x), experts)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None = None,
    glu: ExpertGLU | None = None,
    group_bytes: int = GROUP_BYTES,
    direct: bool | None = None,
    launch: DirectLaunch | tuple[int, ...] = DIRECT_LAUNCH,
) -> torch.Tensor:
    """Same contract as `fp4.moe_experts_fp4` (ids -1: no expert; `glu`: gpt-oss's biases,
    contiguous, and gain). Check `supports` first. `direct`: decode the weights in registers
    (None: `DIRECT`, where the stacks are `fp4_decode.decodable`), else through the bf16 copy, whose
    bound is `group_bytes` (tests pass small ones); `launch`: the in-register way's
    (`DIRECT_LAUNCH`)."""
    glu = glu or ExpertGLU()
    experts, two_inter, half_hidden = gate_up[0].shape
    hidden, inter = 2 * half_hidden, two_inter // 2
    if experts == 0 or topk_ids.numel() == 0:
        return torch.zeros_like(x)
    if DIRECT if direct is None else direct:
        if fp4_decode.decodable(gate_up, down):
            x = x.contiguous()
            # h and y of at most SLICE_BYTES: longer batches in row slices.
            return in_row_chunks(
                topk_ids,
                _slice_pairs(hidden, inter),
                lambda chunk: _direct(
                    x[chunk],
                    topk_ids[chunk],
                    topk_weights[chunk],
                    gate_up,
                    down,
                    limit,
                    glu,
                    launch,
                ),
            )
        if direct:
            raise ValueError(
                "direct=True: these FP4 experts cannot be decoded in registers (it takes "
                "contiguous uint8 stacks on 4-byte boundaries, dims multiples of 64)"
            )
    per_expert = 3 * hidden * inter * x.element_size()
    size = max(1, min(experts, group_bytes // per_expert))
    w13 = torch.empty(size, two_inter, hidden, dtype=x.dtype, device=x.device)
    w2 = torch.empty(size, hidden, inter, dtype=x.dtype, device=x.device)
    max_pairs = max(grouped.GROUPED_MAX_PAIRS, _slice_pairs(hidden, inter))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for first in range(0, experts, size):
        last = min(experts, first + size)
        n = last - first
        dequantize(gate_up[0][first:last], gate_up[1][first:last], w13[:n])
        dequantize(down[0][first:last], down[1][first:last], w2[:n])
        inside = (topk_ids >= first) & (topk_ids < last)
        ids = torch.where(inside, topk_ids - first, -1)
        b13, b2 = (None if b is None else b[first:last] for b in (glu.gate_up_bias, glu.down_bias))
        part = ExpertGLU(b13, b2, glu.alpha)
        out += grouped.moe_experts(
            x, ids, topk_weights, w13[:n], w2[:n], limit=limit, max_pairs=max_pairs, glu=part
        )
    return out.to(x.dtype)
