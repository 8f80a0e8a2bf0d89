"""Routed experts straight from FP4 weights (DeepSeek-V4's e2m1 + ue8m0, kernels/reference/fp4.py),
three Triton launches with no host sync, routed in registers as decode.py is (moe/routing.py).

sm_90 has no FP4 tensor cores: each program loads its expert's packed bytes as int32 words (word
j holds inputs 8j..8j + 7) and their ue8m0 scales, decodes them to x's dtype in registers with
bit moves, two weights per 32-bit operation (`_fp4_step`: the decode, not the bytes, bounds these
kernels), and feeds tl.dot with an fp32 accumulator; no bf16 copy of the weights ever exists.
Every weight is `fp4.dequantize_fp4`'s bit for bit; only the accumulation order differs.
`Tiles` is the tile shape: with `weights_left` the decoded tile is the dot's A operand, which
wgmma takes from registers (at least 64 rows per 4 warps), else B. No load is masked: rows past a
tile's pairs read pair 0's row, columns past the last read its bytes; neither is stored. Batches
past `MAX_PAIRS` pairs run in row chunks, each the same three launches:
1. gate/up: h[pair] = silu(min(g, limit)) * clamp(u, -limit, limit), g, u = x W_gate^T, x W_up^T
   (gpt-oss, `ExpertGLU`: plus their biases, and (u' + 1) * g' * sigmoid(alpha g') instead).
2. down:    y[pair] = weight[pair] * (h[pair] W_down^T (+ its bias)), fp32.
3. sum:     out[row] = sum of the row's top_k y rows, cast to x's dtype.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe.decode import glu_act, sum_pairs
from afdserve.kernels.moe.routing import decode_launch, in_row_chunks, program_pairs, tile_pairs
from afdserve.kernels.reference.layers import ExpertGLU

# Pairs one launch takes (its pair list is held in registers); a larger batch runs in chunks.
MAX_PAIRS = 512


class Tiles(NamedTuple):
    """One launch's tile shape (module docstring). `k_block` is the K step wanted (`k_steps`: a
    dimension it does not divide ends on one narrower step)."""

    gate_up_columns: int
    down_columns: int
    k_block: int = 256
    rows: int = 16  # pairs of one expert sharing a weight tile; tl.dot's smallest height is 16
    warps: int = 4
    stages: int = 3
    weights_left: bool = True


# By pair count, each row used up to its first field. One shape serves every batch: the fastest
# of `tools/fp4_moe_bench.py --sweep` at Flash's shape (docs/benchmarks.md, "Kernel constants").
TILES: tuple[tuple[int, Tiles], ...] = ((MAX_PAIRS, Tiles(64, 128, k_block=128)),)


def tiles_for(pairs: int) -> Tiles:
    return next((t for bound, t in TILES if pairs <= bound), TILES[-1][1])


# The narrowest K step: each step takes four dots of a quarter of it (one per nibble pair of a
# word), and tl.dot's K is at least 16 on the GPU.
MIN_K_BLOCK = 64


def k_steps(dim: int, wanted: int) -> tuple[int, int]:
    """(K step, tail) over a reduction dim: steps of a power of two from MIN_K_BLOCK up to
    `wanted`, then one step of the rest (dim % step: 0 or a power of two, at least
    MIN_K_BLOCK), so a dim that is not a multiple of the step wanted (gpt-oss's 2880 = 64 x 45)
    keeps the wide step rather than falling to the narrowest."""
    if dim % MIN_K_BLOCK:
        raise ValueError(f"reduction dim {dim} is not a multiple of {MIN_K_BLOCK}")
    block = max(triton.next_power_of_2(wanted), MIN_K_BLOCK)
    while block > MIN_K_BLOCK and (block > dim or (dim % block) & (dim % block - 1)):
        block //= 2
    return block, dim % block


def k_constants(dim: int, wanted: int) -> dict[str, int]:
    """`k_steps` as the kernels' K_BLOCK and TAIL."""
    block, tail = k_steps(dim, wanted)
    return {"K_BLOCK": block, "TAIL": tail}


def supports(
    x: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
) -> bool:
    """CUDA bf16/fp16 rows over `decodable` experts. Others take the reference."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    return decodable(gate_up, down) and x.shape[-1] == 2 * gate_up[0].shape[2]


def decodable(
    gate_up: tuple[torch.Tensor, torch.Tensor], down: tuple[torch.Tensor, torch.Tensor]
) -> bool:
    """uint8 packed weights and scales, contiguous, reduction dims multiples of 64
    (`MIN_K_BLOCK`; a scale per 32 inputs), packed bytes that start on a 4-byte boundary (the
    kernels read them as int32 words)."""
    tensors = (*gate_up, *down)
    if not all(t.dtype == torch.uint8 and t.is_contiguous() for t in tensors):
        return False
    if gate_up[0].storage_offset() % 4 or down[0].storage_offset() % 4:
        return False
    hidden, inter = 2 * gate_up[0].shape[2], 2 * down[0].shape[2]
    return hidden % MIN_K_BLOCK == 0 and inter % MIN_K_BLOCK == 0


# Two fp16s' sign, exponent bits 1-0 and top mantissa bit (bits 15, 11-9 and 31, 27-25): where
# `_fp4_step` puts two e2m1 codes. As an int32 (a larger literal would make the ops 64-bit).
FP16_PAIR = tl.constexpr(0x8E008E00 - (1 << 32))


@triton.jit
def _x_slices(x_rows, k0, ROWS: tl.constexpr, K_BLOCK: tl.constexpr):
    """The inputs of nibbles (i, i + 4) of the tile's words for i = 0..3, each [ROWS, K_BLOCK / 4]:
    column 2j + h of slice i is x[:, k0 + 8j + i + 4h], matching `_fp4_step`'s weight order.
    x_rows: [ROWS, 1] pointers to the pairs' rows, all in bounds (a tile's rows past its pairs
    read pair 0's row, and are never stored), so no mask: one contiguous load, then splits."""
    x = tl.load(x_rows + k0 + tl.arange(0, K_BLOCK)[None, :])
    x = tl.reshape(x, (ROWS, K_BLOCK // 8, 2, 2, 2))  # x[:, 8j + 4h + 2a + b] at [:, j, h, a, b]
    b0, b1 = tl.split(x)
    x0, x2 = tl.split(b0)
    x1, x3 = tl.split(b1)
    shape: tl.constexpr = (ROWS, K_BLOCK // 4)
    return (
        tl.reshape(x0, shape),
        tl.reshape(x1, shape),
        tl.reshape(x2, shape),
        tl.reshape(x3, shape),
    )


@triton.jit
def _fp4_step(
    acc,
    xs,
    w_rows,
    s_rows,
    k0,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
):
    """acc += x W^T over inputs [k0, k0 + K_BLOCK) of one weight tile: rows at `w_rows` / `s_rows`
    ([COLUMNS] pointers to a row's int32 words and its scale bytes), xs from `_x_slices`.

    Nibbles i and i + 4 of a word become two fp16s in one int32 (`FP16_PAIR`'s bits): an e2m1
    code there is its value times 2^-14, exactly (e2m1's exponent 0 lands in fp16's subnormals,
    so the odd code 0.5 needs no select). Each fp16 -> fp32 is exact; then times the group's
    factor 2^(s - 127 + 14), the fp32 bits (s + 14) << 23 of the scale byte s (right for
    s <= 240, a scale up to 2^113, which no real group reaches; s <= 1 gives subnormals). For
    bf16 x the pair is packed to bf16 and multiplied as one; for fp16 x the product is fp32,
    rounded once. e2m1 * 2^(s - 127) has at most two significant bits, so every step is exact.
    The dot's K pairs (2j, 2j + 1) are (8j + i, 8j + i + 4), one word's halves: no repacking.
    The words load as [COLUMNS, K / 32, 4] tiles beside their [COLUMNS, K / 32] scale bytes."""
    GROUPS: tl.constexpr = K_BLOCK // 32
    g = tl.arange(0, GROUPS)
    at = k0 // 8 + g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    w = tl.load(w_rows[:, None, None] + at)
    scale = tl.load(s_rows[:, None] + k0 // 32 + g[None, :])
    # [COLUMNS, GROUPS, 1]: 2^(s - 127 + 14), one per 32 inputs (4 words).
    factor = ((scale.to(tl.int32) + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
    # Nibbles i and i + 4 of every word (bits 4i and 16 + 4i) -> two fp16s in one int32 (bits
    # FP16_PAIR). A code's sign must move 3 bits further than its magnitude (1 above it in the
    # nibble, 4 above it in the fp16), onto the next nibble's magnitude; so first the even
    # nibbles (0, 2, 4, 6: `spread`, magnitudes in place, signs 3 up) and the odd ones (`odd`,
    # magnitudes 3 down, signs in place) are pulled apart, a shift and a bit select each; then
    # each pair is one shift and one and.
    spread = (w & 0x07070707) | ((w << 3) & ~0x07070707)
    odd = ((w >> 3) & 0x0E0E0E0E) | (w & ~0x0E0E0E0E)
    halves = (
        (spread << 9) & FP16_PAIR,
        (odd << 8) & FP16_PAIR,
        (spread << 1) & FP16_PAIR,
        odd & FP16_PAIR,
    )
    dtype = xs[0].dtype
    if dtype == tl.bfloat16:
        # bf16 has fp32's exponent range: the factor is a bf16 too, and the multiply a packed
        # bf16 pair (one instruction for two weights) after the pack rather than before it.
        factor = factor.to(tl.bfloat16)
    for i in tl.static_range(4):
        # Both halves of a word side by side: the dot's K pair (2j, 2j + 1) is (8j + i,
        # 8j + i + 4), one register, so no repacking before the fp16 -> fp32 conversions.
        bits = halves[i]
        both = tl.join(bits.to(tl.int16), (bits >> 16).to(tl.int16))  # [COLUMNS, GROUPS, 4, 2]
        value = both.to(tl.float16, bitcast=True).to(tl.float32)
        if dtype == tl.bfloat16:
            value = value.to(tl.bfloat16) * factor[:, :, :, None]
        else:
            value = (value * factor[:, :, :, None]).to(dtype)
        acc = _fp4_dot(acc, xs[i], tl.reshape(value, (COLUMNS, K_BLOCK // 4)), WEIGHTS_LEFT)
    return acc


@triton.jit
def fp4_reduce(
    acc,
    x_rows,
    w_rows,
    s_rows,
    dim,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
):
    """acc += x W^T over all `dim` inputs of one weight tile (`_fp4_step`'s arguments): steps of
    K_BLOCK, then one of TAIL (`k_steps`)."""
    for k0 in range(0, dim - TAIL, K_BLOCK):
        xs = _x_slices(x_rows, k0, ROWS, K_BLOCK)
        acc = _fp4_step(acc, xs, w_rows, s_rows, k0, COLUMNS, K_BLOCK, WEIGHTS_LEFT)
    if TAIL > 0:
        xs = _x_slices(x_rows, dim - TAIL, ROWS, TAIL)
        acc = _fp4_step(acc, xs, w_rows, s_rows, dim - TAIL, COLUMNS, TAIL, WEIGHTS_LEFT)
    return acc


@triton.jit
def _fp4_dot(acc, xs, w, WEIGHTS_LEFT: tl.constexpr):
    """acc += xs w^T, as acc^T += w xs^T when the weights are the A operand."""
    # One return per helper, after a constexpr if: Triton checks every return's type alike.
    if WEIGHTS_LEFT:
        acc = tl.dot(w, tl.trans(xs), acc)
    else:
        acc = tl.dot(xs, tl.trans(w), acc)
    return acc


@triton.jit
def _acc_zeros(ROWS: tl.constexpr, COLUMNS: tl.constexpr, WEIGHTS_LEFT: tl.constexpr):
    if WEIGHTS_LEFT:
        acc = tl.zeros((COLUMNS, ROWS), dtype=tl.float32)
    else:
        acc = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
    return acc


@triton.jit
def _rows_major(acc, WEIGHTS_LEFT: tl.constexpr):
    """The accumulator as [ROWS, COLUMNS]."""
    if WEIGHTS_LEFT:
        acc = tl.trans(acc)
    return acc


@triton.jit(do_not_specialize=["num_pairs"])
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
    w_row,
    s_row,
    limit,
    bias_ptr,
    alpha,
    HAS_LIMIT: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    HAS_ALPHA: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
):
    expert, pair, mine, rank, count, col, col_ok = program_pairs(
        ids_ptr, num_pairs, inter, PAIRS_PAD, BY_EXPERT, COLUMNS
    )
    # One weight tile of 2 * COLUMNS rows, the gate rows of these columns and then their up
    # rows, so one dot of twice the height (at 32 columns the 64 rows wgmma needs) serves both.
    # [E, 2I, H / 8] int32 words and [E, 2I, H / 32] scales: gate rows first, then up rows.
    # w_row = H / 8 and s_row = H / 32 are arguments, not computed here, so that Triton sees
    # them as multiples of 16 and vectorizes the loads of a row (16-byte copies).
    r = tl.arange(0, 2 * COLUMNS)
    # Columns past the last (inter not a multiple of COLUMNS) read the last one's bytes, so the
    # loads need no mask; their outputs are never stored.
    both_col = tl.minimum(tl.program_id(0) * COLUMNS + r % COLUMNS, inter - 1)
    both_row = expert * 2 * inter + (r // COLUMNS) * inter + both_col
    both_w = w_ptr + both_row * w_row
    both_s = s_ptr + both_row * s_row
    if HAS_BIAS:  # [E, 2I], gate half first; an expert slot without pairs reads expert 0's
        bias_row = bias_ptr + tl.maximum(expert, 0) * 2 * inter
        gate_bias = tl.load(bias_row + col, mask=col_ok, other=0.0).to(tl.float32)
        up_bias = tl.load(bias_row + inter + col, mask=col_ok, other=0.0).to(tl.float32)
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs(pair, mine, rank, first, count, ROWS)
        x_rows = x_ptr + (rows // top_k)[:, None] * hidden  # [ROWS, 1]
        acc = _acc_zeros(ROWS, 2 * COLUMNS, WEIGHTS_LEFT)
        acc = fp4_reduce(
            acc, x_rows, both_w, both_s, hidden, ROWS, 2 * COLUMNS, K_BLOCK, TAIL, WEIGHTS_LEFT
        )
        # [ROWS, 2C] -> [ROWS, C, 2] -> gate and up, [ROWS, C] each.
        both = tl.permute(tl.reshape(_rows_major(acc, WEIGHTS_LEFT), (ROWS, 2, COLUMNS)), (0, 2, 1))
        gate, up = tl.split(both)
        if HAS_BIAS:
            gate += gate_bias[None, :]
            up += up_bias[None, :]
        act = glu_act(gate, up, limit, alpha, HAS_LIMIT, HAS_ALPHA)
        out = h_ptr + rows[:, None] * inter + col[None, :]
        tl.store(out, act.to(h_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


@triton.jit(do_not_specialize=["num_pairs"])
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
    w_row,
    s_row,
    bias_ptr,
    HAS_BIAS: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
):
    expert, pair, mine, rank, count, col, col_ok = program_pairs(
        ids_ptr, num_pairs, hidden, PAIRS_PAD, BY_EXPERT, COLUMNS
    )
    if HAS_BIAS:  # [E, H]; an expert slot without pairs reads expert 0's
        bias = tl.load(bias_ptr + tl.maximum(expert, 0) * hidden + col, mask=col_ok, other=0.0)
        bias = bias.to(tl.float32)
    # [E, H, I / 8] int32 words and [E, H, I / 32] scales.
    # w_row = I / 8, s_row = I / 32; columns past the last read its bytes (as in gate/up).
    load_col = tl.minimum(col, hidden - 1)
    down_w = w_ptr + expert * hidden * w_row + load_col * w_row
    down_s = s_ptr + expert * hidden * s_row + load_col * s_row
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs(pair, mine, rank, first, count, ROWS)
        h_rows = h_ptr + rows[:, None] * inter
        acc = _acc_zeros(ROWS, COLUMNS, WEIGHTS_LEFT)
        acc = fp4_reduce(
            acc, h_rows, down_w, down_s, inter, ROWS, COLUMNS, K_BLOCK, TAIL, WEIGHTS_LEFT
        )
        acc = _rows_major(acc, WEIGHTS_LEFT)
        if HAS_BIAS:
            acc += bias[None, :]
        weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
        out = y_ptr + rows[:, None] * hidden + col[None, :]
        tl.store(out, acc * weight[:, None], mask=row_ok[:, None] & col_ok[None, :])


def _words(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., n / 2] as int32 words [..., n / 8]: word j holds inputs 8j..8j + 7,
    input 8j + i in its nibble i (bits 4i..4i + 3: little-endian, byte b is bits 8b..8b + 7)."""
    return packed.view(torch.int32)


def _launch(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None,
    tiles: Tiles,
    glu: ExpertGLU,
) -> torch.Tensor:
    """One chunk of at most `MAX_PAIRS` pairs: x [rows, hidden], topk_ids / topk_weights
    [rows, top_k] -> [rows, hidden]."""
    top_k, hidden = topk_ids.shape[1], x.shape[1]
    inter = 2 * down[0].shape[2]
    experts = gate_up[0].shape[0]
    launch = decode_launch(x, topk_ids, topk_weights, experts, inter, tiles.rows)
    ids, pairs, slots = launch.ids, launch.ids.numel(), launch.slots
    common = dict(
        **launch.routing,
        WEIGHTS_LEFT=tiles.weights_left,
        num_warps=tiles.warps,
        num_stages=tiles.stages,
    )
    columns = tiles.gate_up_columns
    _gate_up_kernel[(triton.cdiv(inter, columns), slots)](
        x,
        ids,
        _words(gate_up[0]),
        gate_up[1],
        launch.h,
        pairs,
        top_k,
        hidden,
        inter,
        hidden // 8,
        hidden // 32,
        0.0 if limit is None else float(limit),
        x if glu.gate_up_bias is None else glu.gate_up_bias,  # unused placeholder without
        1.0 if glu.alpha is None else float(glu.alpha),
        HAS_LIMIT=limit is not None,
        HAS_BIAS=glu.gate_up_bias is not None,
        HAS_ALPHA=glu.alpha is not None,
        COLUMNS=columns,
        **k_constants(hidden, tiles.k_block),
        **common,
    )
    columns = tiles.down_columns
    _down_kernel[(triton.cdiv(hidden, columns), slots)](
        launch.h,
        ids,
        launch.weights,
        _words(down[0]),
        down[1],
        launch.y,
        pairs,
        hidden,
        inter,
        inter // 8,
        inter // 32,
        x if glu.down_bias is None else glu.down_bias,  # unused placeholder without
        HAS_BIAS=glu.down_bias is not None,
        COLUMNS=columns,
        **k_constants(inter, tiles.k_block),
        **common,
    )
    return sum_pairs(launch.y, ids, launch.out, experts)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None = None,
    tiles: Callable[[int], Tiles] = tiles_for,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """Same contract as `fp4.moe_experts_fp4`; check `supports` first. Each id is in
    [0, experts) or -1 (no expert here: the pair is skipped, routing.expert_pairs). Each
    chunk's tile shape is `tiles(pairs)` (`TILES`' choice; the sweep and tests pass their own).
    `glu`: gpt-oss's biases (contiguous) and gain."""
    glu = glu or ExpertGLU()
    if topk_ids.shape[0] == 0:
        return torch.zeros_like(x)
    x = x.contiguous()

    def run(chunk: slice) -> torch.Tensor:
        ids = topk_ids[chunk]
        shape = tiles(ids.numel())
        return _launch(x[chunk], ids, topk_weights[chunk], gate_up, down, limit, shape, glu)

    return in_row_chunks(topk_ids, MAX_PAIRS, run)
