"""Routed experts straight from FP4 weights (DeepSeek-V4's e2m1 + ue8m0, kernels/reference/fp4.py),
three Triton launches with no host sync, each program ranking its pairs a chunk of the pair list
at a time (moe/routing.py's by-chunk form).

sm_90 has no FP4 tensor cores: each program loads its expert's packed bytes as int32 words (word
j holds inputs 8j..8j + 7) and their ue8m0 scales, decodes them to x's dtype in registers with
bit moves, two weights per 32-bit operation (`_fp4_step`), and feeds tl.dot with an fp32
accumulator; no bf16 copy of the weights ever exists. Every weight is `fp4.dequantize_fp4`'s bit
for bit; only the accumulation order differs. Neither the bytes nor the decode's instructions
bound these kernels: bf16 rows' decode at 3.3 instructions a weight rather than 4.9 gained 2-6%
(docs/benchmarks.md, 2026-12-06); they wait on each quarter step's dot, so they are capped at
`Tiles.max_registers` for three programs an SM where 255 registers a thread allowed two (4-5%
faster at 8 and 64 rows, the eighteenth session's section there).
`Tiles` is the tile shape: with `weights_left` the decoded tile is the dot's A operand, which
wgmma takes from registers (at least 64 rows per 4 warps), else B. No load is masked: rows past a
tile's pairs read pair 0's row, columns past the last read its bytes; neither is stored. Batches
past `MAX_PAIRS` pairs run in row chunks, each the same three launches:
1. gate/up: h[pair] = silu(min(g, limit)) * clamp(u, -limit, limit), g, u = x W_gate^T, x W_up^T
   (gpt-oss, `ExpertGLU`: plus their biases, and (u' + 1) * g' * sigmoid(alpha g') instead).
2. down:    y[pair] = weight[pair] * (h[pair] W_down^T (+ its bias)), fp32.
3. sum:     out[row] = sum of the row's top_k y rows, cast to x's dtype.
With `Tiles.splits` > 1 each of the first two cuts its reduction into K ranges, a program each
(grid axis 2), writes float32 partials, and the last of a tile's splits to finish sums them in
split order and applies the step's epilogue (fp8_w8a8.py's way): more weight bytes in flight
where a few pairs leave most SMs a single program. With `Tiles.one_dot` each K step is one dot
over all eight nibbles of its words rather than four (`_fp4_step`): one `wgmma` wait a step.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe.decode import glu_act, sum_pairs
from afdserve.kernels.moe.routing import (
    decode_launch,
    in_row_chunks,
    program_pairs_by_chunk,
    tile_pairs_by_chunk,
)
from afdserve.kernels.reference import fp4
from afdserve.kernels.reference.layers import ExpertGLU
from afdserve.kernels.triton.counters import tile_counters

# Pairs one launch takes (each program re-reads the pair list); a larger batch runs in row chunks.
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
    # Registers a thread at most: three programs of 4 warps an SM (65536 / 384 = 170, ptxas
    # allocates by 8). Left to itself ptxas gives the down kernel 193-219 (two programs an SM,
    # half its issue slots idle waiting on the dots) where 153-168 hold it without a spill
    # (tests/kernels/test_fp4_moe_compile.py checks the cubin's stack).
    max_registers: int | None = 168
    # K ranges a column tile's reduction is cut into, one program each (`SPLIT_COUNTERS`): at a
    # batch of 1 a launch has only ~190 programs, each a serial chain of 32 K steps.
    splits: int = 1
    # One dot a K step over all eight nibbles of the tile's words (`_fp4_step`), where four dots
    # of a quarter each wait in turn: Triton waits on each dot whose A operand is in registers.
    one_dot: bool = False

    def options(self) -> dict:
        """The launch options of this shape (a launch's, and a compile test's)."""
        return {"num_warps": self.warps, "num_stages": self.stages, "maxnreg": self.max_registers}


# By pair count, each row used up to its first field: the sweep's shape (`tools/fp4_moe_bench.py
# --sweep` at Flash's shape) with one dot a K step, which won at every batch, and a K split of two
# for a batch of one, the only batch a split won (`--splits`; docs/benchmarks.md, "One dot a K
# step and a split for one row, timed").
TILES: tuple[tuple[int, Tiles], ...] = (
    (6, Tiles(64, 128, k_block=128, splits=2, one_dot=True)),
    (MAX_PAIRS, Tiles(64, 128, k_block=128, one_dot=True)),
)


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
# `_fp4_step` puts two e2m1 codes for fp16 and float32 rows. As an int32 (a larger literal would
# make the ops 64-bit).
FP16_PAIR = tl.constexpr(0x8E008E00 - (1 << 32))
# The same for two bf16s (bits 15, 8-6 and 31, 24-22), for bf16 rows.
BF16_PAIR = tl.constexpr(0x81C081C0 - (1 << 32))
# Nibbles 0, 1, 4 and 5's magnitudes (`_fp4_step`).
LOW_MAGNITUDES = tl.constexpr(0x00770077)
# Nibbles 2, 3, 6 and 7's signs (`_fp4_step`).
HIGH_SIGNS = tl.constexpr(0x88008800 - (1 << 32))
# bf16 rows: a code in BF16_PAIR's bits is its value times 2^-126, the weight that value times
# 2^(s - 127), so the factor would be 2^(s - 1), past bf16's range for s > 128. The weights are
# taken 2^-16 small instead (factor 2^(s - 17)) and the sums 2^16 large after the reduction: both
# exact, so bf16 rows get every weight bit for bit for scale bytes s in [SCALE_BYTES]: 2^-109 to
# 2^17 (no real group is outside: checkpoint loads refuse larger, `fp4.scale_problem`).
BF16_SHIFT = tl.constexpr(16)
# s >= 18: 0.5 x 2^(s - 143), the smallest product, a normal bf16; s <= 144: the factor one.
SCALE_BYTES = (1 + 1 + BF16_SHIFT.value, fp4.MAX_SCALE_BYTE)
assert fp4.MAX_SCALE_BYTE == 127 + 1 + BF16_SHIFT.value


@triton.jit
def _x_slices(x_rows, k0, ROWS: tl.constexpr, K_BLOCK: tl.constexpr, ONE_DOT: tl.constexpr):
    """x's [ROWS, K_BLOCK] tile in `_fp4_step`'s weight order. Four dots: the inputs of nibbles
    (i, i + 4) of the tile's words for i = 0..3, each [ROWS, K_BLOCK / 4]: column 2j + h of slice
    i is x[:, k0 + 8j + i + 4h]. One dot: the tile with column 32g + 16(i >> 1) + 8(i & 1) + 2w
    + h holding x[:, k0 + 8(4g + w) + i + 4h].
    x_rows: [ROWS, 1] pointers to the pairs' rows, all in bounds (a tile's rows past its pairs
    read pair 0's row, and are never stored), so no mask: one contiguous load, then splits."""
    x = tl.load(x_rows + k0 + tl.arange(0, K_BLOCK)[None, :])
    if ONE_DOT:
        x = tl.reshape(x, (ROWS, K_BLOCK // 32, 4, 2, 2, 2))  # [:, g, w, h, i >> 1, i & 1]
        xs = tl.reshape(tl.permute(x, (0, 1, 4, 5, 2, 3)), (ROWS, K_BLOCK))
    else:
        # x[:, 8j + 4h + 2a + b] at [:, j, h, a, b]
        x = tl.reshape(x, (ROWS, K_BLOCK // 8, 2, 2, 2))
        b0, b1 = tl.split(x)
        x0, x2 = tl.split(b0)
        x1, x3 = tl.split(b1)
        shape: tl.constexpr = (ROWS, K_BLOCK // 4)
        xs = (
            tl.reshape(x0, shape),
            tl.reshape(x1, shape),
            tl.reshape(x2, shape),
            tl.reshape(x3, shape),
        )
    return xs


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
    ONE_DOT: tl.constexpr,
):
    """acc += x W^T over inputs [k0, k0 + K_BLOCK) of one weight tile: rows at `w_rows` / `s_rows`
    ([COLUMNS] pointers to a row's int32 words and its scale bytes), xs from `_x_slices`.

    Nibbles i and i + 4 of a word become two 16-bit floats in one int32, each code's sign, and
    its magnitude as the float's exponent bits 1-0 and top mantissa bit: the code's value times
    2^-126 (bf16) or 2^-14 (fp16), exactly, e2m1's exponent 0 landing in the float's subnormals,
    so the odd code 0.5 needs no select. For bf16 x the pair is the dot's operand after one
    packed bf16 multiply by the group's factor 2^(s - 127 + 126 - BF16_SHIFT) (`SCALE_BYTES`);
    for fp16 and float32 x each fp16 widens to fp32 (exact) and takes the factor 2^(s - 127 +
    14), the fp32 bits (s + 14) << 23 (right for s <= 240), then rounds once to x's dtype.
    e2m1 * 2^(s - 127) has at most two significant bits, so every step is exact. The dot's K
    pairs (2j, 2j + 1) are (8j + i, 8j + i + 4), one word's halves: no repacking. The words load
    as [COLUMNS, K / 32, 4] tiles beside their [COLUMNS, K / 32] scale bytes. `ONE_DOT`: the four
    quarters stacked in the order each thread already holds them (word j = 4g + w, w across the
    four threads of a dot fragment's row), one dot of the whole K step, one wait (sm_90 SASS:
    one `WARPGROUP.DEPBAR` a step where four dots have four)."""
    GROUPS: tl.constexpr = K_BLOCK // 32
    g = tl.arange(0, GROUPS)
    at = k0 // 8 + g[None, :, None] * 4 + tl.arange(0, 4)[None, None, :]
    w = tl.load(w_rows[:, None, None] + at)
    scale = tl.load(s_rows[:, None] + k0 // 32 + g[None, :]).to(tl.int32)
    dtype = xs.dtype if ONE_DOT else xs[0].dtype
    if dtype == tl.bfloat16:
        # A code's sign must land 6 bits further than its magnitude (3 above it in the nibble, 9
        # above it in the bf16): nibbles 0, 1, 4, 5 keep their magnitudes and take their signs 6
        # up (`low`), nibbles 2, 3, 6, 7 keep their signs and take their magnitudes 6 down
        # (`high`), a shift and a bit select each; then each pair is at most a shift and an and.
        low = (w & LOW_MAGNITUDES) | ((w << 6) & ~LOW_MAGNITUDES)
        high = (w & HIGH_SIGNS) | ((w >> 6) & ~HIGH_SIGNS)
        halves = (
            (low << 6) & BF16_PAIR,
            (low << 2) & BF16_PAIR,
            (high << 4) & BF16_PAIR,
            high & BF16_PAIR,
        )
        # [COLUMNS, GROUPS, 1]: 2^(s - 1 - BF16_SHIFT) as bf16 bits, twice.
        factor = (scale + 126 - BF16_SHIFT) << 7
        factor = (factor | (factor << 16))[:, :, None]
    else:
        # The same for fp16, a sign 3 bits further than its magnitude: the even nibbles keep
        # their magnitudes and take their signs 3 up (`spread`), the odd ones keep their signs
        # and take their magnitudes 3 down (`odd`).
        spread = (w & 0x07070707) | ((w << 3) & ~0x07070707)
        odd = ((w >> 3) & 0x0E0E0E0E) | (w & ~0x0E0E0E0E)
        halves = (
            (spread << 9) & FP16_PAIR,
            (odd << 8) & FP16_PAIR,
            (spread << 1) & FP16_PAIR,
            odd & FP16_PAIR,
        )
        factor = ((scale + 14) << 23).to(tl.float32, bitcast=True)[:, :, None]
    if ONE_DOT:
        b0, b1, b2, b3 = halves
        if dtype == tl.bfloat16:
            b0 = _bf16_pair_product(b0, factor)
            b1 = _bf16_pair_product(b1, factor)
            b2 = _bf16_pair_product(b2, factor)
            b3 = _bf16_pair_product(b3, factor)
        # [C, G, 4 (w), 2 (i & 1), 2 (i >> 1)] -> [C, G, i >> 1, i & 1, w], then each word's
        # halves h: K index 32g + 16(i >> 1) + 8(i & 1) + 2w + h (`_x_slices`' order).
        bits = tl.permute(tl.join(tl.join(b0, b1), tl.join(b2, b3)), (0, 1, 4, 3, 2))
        value = _operand(bits, factor[:, :, :, None, None, None], dtype)
        acc = _fp4_dot(acc, xs, tl.reshape(value, (COLUMNS, K_BLOCK)), WEIGHTS_LEFT)
    else:
        for i in tl.static_range(4):
            # Both halves of a word side by side: the dot's K pair (2j, 2j + 1) is (8j + i,
            # 8j + i + 4), one register, so no repacking.
            bits = halves[i]
            if dtype == tl.bfloat16:
                bits = _bf16_pair_product(bits, factor)
            value = _operand(bits, factor[:, :, :, None], dtype)  # [C, G, 4, 2]
            acc = _fp4_dot(acc, xs[i], tl.reshape(value, (COLUMNS, K_BLOCK // 4)), WEIGHTS_LEFT)
    return acc


@triton.jit
def _operand(bits, factor, dtype: tl.constexpr):
    """Words of two 16-bit values (`bits`: bf16 ones already scaled by `_bf16_pair_product`, fp16
    ones not) as the dot's operand in x's `dtype`, each word's halves side by side: [..., 2].
    fp16 values are scaled by `factor` (broadcast to [..., 2]) in float32."""
    both = tl.join(bits.to(tl.int16), (bits >> 16).to(tl.int16))
    if dtype == tl.bfloat16:
        value = both.to(tl.bfloat16, bitcast=True)
    else:
        value = (both.to(tl.float16, bitcast=True).to(tl.float32) * factor).to(dtype)
    return value


@triton.jit
def _bf16_pair_product(bits, factor):
    """Two bf16s in an int32 times two others, as one packed multiply (Triton multiplies a bf16
    tensor an element at a time, and re-pairing the elements costs more than the multiply)."""
    return tl.inline_asm_elementwise(
        "mul.rn.bf16x2 $0, $1, $2;", "=r,r,r", [bits, factor], dtype=tl.int32, is_pure=True, pack=1
    )


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
    ONE_DOT: tl.constexpr = False,
):
    """acc += x W^T over all `dim` inputs of one weight tile (`_fp4_step`'s arguments): steps of
    K_BLOCK, then one of TAIL (`k_steps`)."""
    return fp4_reduce_range(
        acc, x_rows, w_rows, s_rows, 0, dim, True, dim, ROWS, COLUMNS, K_BLOCK, TAIL,
        WEIGHTS_LEFT, ONE_DOT,
    )  # fmt: skip


@triton.jit
def fp4_reduce_range(
    acc,
    x_rows,
    w_rows,
    s_rows,
    k_begin,
    k_end,
    with_tail,
    dim,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    """`fp4_reduce` over the K steps in [k_begin, k_end) (multiples of K_BLOCK), and the TAIL
    step if `with_tail`: one split's part of the sum."""
    # bf16 rows sum weights 2^-BF16_SHIFT small (`_fp4_step`): the sums so far the same, exactly.
    if x_rows.dtype.element_ty == tl.bfloat16:
        acc = acc * (1.0 / (1 << BF16_SHIFT))
    for k0 in range(k_begin, tl.minimum(k_end, dim - TAIL), K_BLOCK):
        xs = _x_slices(x_rows, k0, ROWS, K_BLOCK, ONE_DOT)
        acc = _fp4_step(acc, xs, w_rows, s_rows, k0, COLUMNS, K_BLOCK, WEIGHTS_LEFT, ONE_DOT)
    if TAIL > 0:
        if with_tail:
            xs = _x_slices(x_rows, dim - TAIL, ROWS, TAIL, ONE_DOT)
            acc = _fp4_step(
                acc, xs, w_rows, s_rows, dim - TAIL, COLUMNS, TAIL, WEIGHTS_LEFT, ONE_DOT
            )
    if x_rows.dtype.element_ty == tl.bfloat16:
        acc = acc * (1 << BF16_SHIFT)
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


@triton.jit
def _split_range(k_per_split, dim, SPLITS: tl.constexpr):
    """This program's K range (grid axis 2) and whether it takes the TAIL step: all of it for
    one split, as `fp4_reduce`."""
    if SPLITS == 1:
        k_begin = 0
        k_end = dim
        with_tail = True
    else:
        split = tl.program_id(2)
        k_begin = split * k_per_split
        k_end = k_begin + k_per_split
        with_tail = split == SPLITS - 1
    return k_begin, k_end, with_tail


@triton.jit
def _counter(count_ptr):
    """This program's (column tile, expert slot) counter."""
    return count_ptr + tl.program_id(1) * tl.num_programs(0) + tl.program_id(0)


@triton.jit
def _counted_in_last(count_ptr, SPLITS: tl.constexpr):
    """Counts this split in on its tile's counter; whether it was the last to finish, so that
    every split's partial is in memory (in L2: read them with .cg)."""
    tl.debug_barrier()  # every thread's partial stored before this split counts in
    return tl.atomic_add(_counter(count_ptr), 1, sem="acq_rel", scope="gpu") == SPLITS - 1


@triton.jit
def _reset_counter(count_ptr):
    """The last split leaves its counter at zero for the next launch (and graph replay)."""
    tl.atomic_xchg(_counter(count_ptr), 0)


@triton.jit
def _split_sum(parts, stride, mask, SPLITS: tl.constexpr):
    """The splits' partials at `parts` (split s at s * stride), summed in split order."""
    total = tl.load(parts, mask=mask, other=0.0, cache_modifier=".cg")
    for split in tl.static_range(1, SPLITS):
        total += tl.load(parts + split * stride, mask=mask, other=0.0, cache_modifier=".cg")
    return total


@triton.jit
def _store_act(
    acc, mask, out, gate_bias, up_bias, limit, alpha, HAS_LIMIT, HAS_BIAS, HAS_ALPHA, COLUMNS
):
    """h = the GLU of a tile's summed [ROWS, 2C] gate and up columns (module docstring, 1)."""
    # [ROWS, 2C] -> [ROWS, C, 2] -> gate and up, [ROWS, C] each.
    ROWS: tl.constexpr = acc.shape[0]
    gate, up = tl.split(tl.permute(tl.reshape(acc, (ROWS, 2, COLUMNS)), (0, 2, 1)))
    if HAS_BIAS:
        gate += gate_bias[None, :]
        up += up_bias[None, :]
    act = glu_act(gate, up, limit, alpha, HAS_LIMIT, HAS_ALPHA)
    tl.store(out, act.to(out.dtype.element_ty), mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _gate_up_kernel(
    x_ptr,
    ids_ptr,
    w_ptr,
    s_ptr,
    h_ptr,
    part_ptr,
    count_ptr,
    num_pairs,
    top_k,
    hidden,
    inter,
    w_row,
    s_row,
    k_per_split,
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
    SPLITS: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    expert, owns, count, col, col_ok = program_pairs_by_chunk(
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
    gate_bias, up_bias = col, col  # placeholders without a bias
    if HAS_BIAS:  # [E, 2I], gate half first; an expert slot without pairs reads expert 0's
        bias_row = bias_ptr + tl.maximum(expert, 0) * 2 * inter
        gate_bias = tl.load(bias_row + col, mask=col_ok, other=0.0).to(tl.float32)
        up_bias = tl.load(bias_row + inter + col, mask=col_ok, other=0.0).to(tl.float32)
    k_begin, k_end, with_tail = _split_range(k_per_split, hidden, SPLITS)
    # Split s's float32 partials (SPLITS > 1): [s, pair, column tile, its 2C accumulator columns].
    part_row = tl.num_programs(0) * 2 * COLUMNS
    split_stride = num_pairs * part_row
    part = part_ptr + tl.program_id(0) * 2 * COLUMNS + r[None, :]
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs_by_chunk(
            ids_ptr, num_pairs, expert, owns, first, count, PAIRS_PAD, ROWS
        )
        x_rows = x_ptr + (rows // top_k)[:, None] * hidden  # [ROWS, 1]
        acc = _acc_zeros(ROWS, 2 * COLUMNS, WEIGHTS_LEFT)
        acc = fp4_reduce_range(
            acc,
            x_rows,
            both_w,
            both_s,
            k_begin,
            k_end,
            with_tail,
            hidden,
            ROWS,
            2 * COLUMNS,
            K_BLOCK,
            TAIL,
            WEIGHTS_LEFT,
            ONE_DOT,
        )
        acc = _rows_major(acc, WEIGHTS_LEFT)  # [ROWS, 2C]: the gate columns, then the up ones
        if SPLITS == 1:
            out = h_ptr + rows[:, None] * inter + col[None, :]
            _store_act(
                acc, row_ok[:, None] & col_ok[None, :], out, gate_bias, up_bias, limit, alpha,
                HAS_LIMIT, HAS_BIAS, HAS_ALPHA, COLUMNS,
            )  # fmt: skip
        else:  # the [ROWS, 2C] tile as it is: its last split splits it
            tl.store(part + rows[:, None] * part_row + tl.program_id(2) * split_stride, acc,
                     mask=row_ok[:, None])  # fmt: skip
    if SPLITS > 1:
        if count > 0:
            if _counted_in_last(count_ptr, SPLITS):
                for first in range(0, count, ROWS):
                    rows, row_ok = tile_pairs_by_chunk(
                        ids_ptr, num_pairs, expert, owns, first, count, PAIRS_PAD, ROWS
                    )
                    total = _split_sum(part + rows[:, None] * part_row, split_stride,
                                       row_ok[:, None], SPLITS)  # fmt: skip
                    out = h_ptr + rows[:, None] * inter + col[None, :]
                    _store_act(
                        total, row_ok[:, None] & col_ok[None, :], out, gate_bias, up_bias, limit,
                        alpha, HAS_LIMIT, HAS_BIAS, HAS_ALPHA, COLUMNS,
                    )  # fmt: skip
                _reset_counter(count_ptr)


@triton.jit
def _store_down(acc, rows, row_ok, mask, out, bias, weights_ptr, HAS_BIAS: tl.constexpr):
    """y = the pair's weight times a tile's summed down columns (module docstring, 2)."""
    if HAS_BIAS:
        acc += bias[None, :]
    weight = tl.load(weights_ptr + rows, mask=row_ok, other=0.0).to(tl.float32)
    tl.store(out, acc * weight[:, None], mask=mask)


@triton.jit(do_not_specialize=["num_pairs"])
def _down_kernel(
    h_ptr,
    ids_ptr,
    weights_ptr,
    w_ptr,
    s_ptr,
    y_ptr,
    part_ptr,
    count_ptr,
    num_pairs,
    hidden,
    inter,
    w_row,
    s_row,
    k_per_split,
    bias_ptr,
    HAS_BIAS: tl.constexpr,
    PAIRS_PAD: tl.constexpr,
    BY_EXPERT: tl.constexpr,
    ROWS: tl.constexpr,
    COLUMNS: tl.constexpr,
    K_BLOCK: tl.constexpr,
    TAIL: tl.constexpr,
    WEIGHTS_LEFT: tl.constexpr,
    SPLITS: tl.constexpr,
    ONE_DOT: tl.constexpr,
):
    expert, owns, count, col, col_ok = program_pairs_by_chunk(
        ids_ptr, num_pairs, hidden, PAIRS_PAD, BY_EXPERT, COLUMNS
    )
    bias = col  # a placeholder without one
    if HAS_BIAS:  # [E, H]; an expert slot without pairs reads expert 0's
        bias = tl.load(bias_ptr + tl.maximum(expert, 0) * hidden + col, mask=col_ok, other=0.0)
        bias = bias.to(tl.float32)
    # [E, H, I / 8] int32 words and [E, H, I / 32] scales.
    # w_row = I / 8, s_row = I / 32; columns past the last read its bytes (as in gate/up).
    load_col = tl.minimum(col, hidden - 1)
    down_w = w_ptr + expert * hidden * w_row + load_col * w_row
    down_s = s_ptr + expert * hidden * s_row + load_col * s_row
    k_begin, k_end, with_tail = _split_range(k_per_split, inter, SPLITS)
    split_stride = num_pairs * hidden  # split s's float32 partials at [s, pair, column]
    for first in range(0, count, ROWS):
        rows, row_ok = tile_pairs_by_chunk(
            ids_ptr, num_pairs, expert, owns, first, count, PAIRS_PAD, ROWS
        )
        h_rows = h_ptr + rows[:, None] * inter
        acc = _acc_zeros(ROWS, COLUMNS, WEIGHTS_LEFT)
        acc = fp4_reduce_range(
            acc,
            h_rows,
            down_w,
            down_s,
            k_begin,
            k_end,
            with_tail,
            inter,
            ROWS,
            COLUMNS,
            K_BLOCK,
            TAIL,
            WEIGHTS_LEFT,
            ONE_DOT,
        )
        acc = _rows_major(acc, WEIGHTS_LEFT)
        mask = row_ok[:, None] & col_ok[None, :]
        if SPLITS == 1:
            out = y_ptr + rows[:, None] * hidden + col[None, :]
            _store_down(acc, rows, row_ok, mask, out, bias, weights_ptr, HAS_BIAS)
        else:
            part = part_ptr + tl.program_id(2) * split_stride + rows[:, None] * hidden
            tl.store(part + col[None, :], acc, mask=mask)
    if SPLITS > 1:
        if count > 0:
            if _counted_in_last(count_ptr, SPLITS):
                for first in range(0, count, ROWS):
                    rows, row_ok = tile_pairs_by_chunk(
                        ids_ptr, num_pairs, expert, owns, first, count, PAIRS_PAD, ROWS
                    )
                    mask = row_ok[:, None] & col_ok[None, :]
                    part = part_ptr + rows[:, None] * hidden + col[None, :]
                    acc = _split_sum(part, split_stride, mask, SPLITS)
                    out = y_ptr + rows[:, None] * hidden + col[None, :]
                    _store_down(acc, rows, row_ok, mask, out, bias, weights_ptr, HAS_BIAS)
                _reset_counter(count_ptr)


def _words(packed: torch.Tensor) -> torch.Tensor:
    """Packed bytes [..., n / 2] as int32 words [..., n / 8]: word j holds inputs 8j..8j + 7,
    input 8j + i in its nibble i (bits 4i..4i + 3: little-endian, byte b is bits 8b..8b + 7)."""
    return packed.view(torch.int32)


# Counters a split launch's (column tile, expert slot) programs count in on, per weight
# (`counters.tile_counters`). A launch with more of those programs runs unsplit.
SPLIT_COUNTERS = 4096


class Split(NamedTuple):
    """One kernel's K split: `splits` ranges of `k_per_split` inputs (the last also takes the
    TAIL step), summed in split order by each tile's last split to finish."""

    splits: int
    k_per_split: int

    def partials(self, pairs: int, width: int, like: torch.Tensor) -> torch.Tensor:
        """The float32 partials [splits, pairs, width] (a placeholder unsplit)."""
        if self.splits == 1:
            return like
        return torch.empty(self.splits, pairs, width, dtype=torch.float32, device=like.device)

    def counters(self, weight: torch.Tensor) -> torch.Tensor:
        """The weight's zeroed counters (a placeholder unsplit)."""
        return weight if self.splits == 1 else tile_counters(weight, SPLIT_COUNTERS)


def _splits(wanted: int, dim: int, step: dict[str, int], programs: int) -> Split:
    """At most `wanted` splits of a reduction over `dim` inputs, each a whole number of its
    K_BLOCK steps (`k_constants`' `step`); one where the launch's programs outnumber
    `SPLIT_COUNTERS`, or with a single step."""
    block, tail = step["K_BLOCK"], step["TAIL"]
    blocks = (dim - tail) // block
    if wanted <= 1 or programs > SPLIT_COUNTERS or blocks < 2:
        return Split(1, dim)
    per_split = triton.cdiv(blocks, min(wanted, blocks))
    return Split(triton.cdiv(blocks, per_split), per_split * block)


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
    steps = {dim: k_constants(dim, tiles.k_block) for dim in (hidden, inter)}
    tails = [dim for dim, step in steps.items() if step["TAIL"]]
    if tails and not tiles.weights_left:
        # Compiled for the GPU (Triton 3.6, sm_90), this order sums the narrower last K step
        # twice (tests/gpu/test_fp4_moe.py reads the weights back); `TILES` never picks it.
        raise ValueError(
            f"{tiles}: the weights as the dot's B operand over dims {tails}, which end on a "
            f"narrower K step than {tiles.k_block}; allowed: weights_left=True, or dims that "
            "are multiples of the K step"
        )
    experts = gate_up[0].shape[0]
    launch = decode_launch(x, topk_ids, topk_weights, experts, inter, tiles.rows)
    ids, pairs, slots = launch.ids, launch.ids.numel(), launch.slots
    common = dict(
        **launch.routing,
        WEIGHTS_LEFT=tiles.weights_left,
        ONE_DOT=tiles.one_dot,
        **tiles.options(),
    )
    columns = tiles.gate_up_columns
    split = _splits(tiles.splits, hidden, steps[hidden], triton.cdiv(inter, columns) * slots)
    _gate_up_kernel[(triton.cdiv(inter, columns), slots, split.splits)](
        x,
        ids,
        _words(gate_up[0]),
        gate_up[1],
        launch.h,
        split.partials(pairs, triton.cdiv(inter, columns) * 2 * columns, x),
        split.counters(gate_up[0]),
        pairs,
        top_k,
        hidden,
        inter,
        hidden // 8,
        hidden // 32,
        split.k_per_split,
        0.0 if limit is None else float(limit),
        x if glu.gate_up_bias is None else glu.gate_up_bias,  # unused placeholder without
        1.0 if glu.alpha is None else float(glu.alpha),
        HAS_LIMIT=limit is not None,
        HAS_BIAS=glu.gate_up_bias is not None,
        HAS_ALPHA=glu.alpha is not None,
        COLUMNS=columns,
        SPLITS=split.splits,
        **steps[hidden],
        **common,
    )
    columns = tiles.down_columns
    split = _splits(tiles.splits, inter, steps[inter], triton.cdiv(hidden, columns) * slots)
    _down_kernel[(triton.cdiv(hidden, columns), slots, split.splits)](
        launch.h,
        ids,
        launch.weights,
        _words(down[0]),
        down[1],
        launch.y,
        split.partials(pairs, hidden, x),
        split.counters(down[0]),
        pairs,
        hidden,
        inter,
        inter // 8,
        inter // 32,
        split.k_per_split,
        x if glu.down_bias is None else glu.down_bias,  # unused placeholder without
        HAS_BIAS=glu.down_bias is not None,
        COLUMNS=columns,
        SPLITS=split.splits,
        **steps[inter],
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
