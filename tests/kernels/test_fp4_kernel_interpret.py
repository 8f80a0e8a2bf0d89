"""The FP4 expert kernels' decode (kernels/moe/fp4_decode.py) on CPU, against the plain-torch
reference (`fp4.dequantize_fp4`, then `reference.moe_experts` in float32).

1. The decode's integer formula, written again here in torch int32 ops, over all 16 e2m1 codes
   in all 8 nibbles of a word and every scale byte it supports (0..240): bit for bit the
   reference's float32 weights, and so its bf16 / fp16 ones.
2. The real kernels under Triton's interpreter (TRITON_INTERPRET=1, numpy), in a subprocess
   because the variable must be set before any @triton.jit function is defined: small experts
   with random bytes (every code) and a spread of scale bytes, float32 rows (the weights exact:
   only the accumulation order differs, so the tolerance is float32's) and fp16 rows (the
   kernels' fp16 h), both operand orders, K steps as wide as and wider than the dims, and a batch
   of more pairs than one launch takes. Triton 3.9's interpreter computes bf16 wrongly (its
   bf16 loads and dots give garbage on any kernel), so bf16 is tests/gpu/test_fp4_moe.py's.

Runtime: a few seconds; needs Triton (skipped where it is not installed)."""

from __future__ import annotations

import torch

from afdserve.kernels.reference import fp4
from tests.kernels.interpret import run_interpreted

FP16_PAIR = 0x8E008E00 - (1 << 32)  # as the kernel's
MAX_SCALE = 240  # the largest scale byte the kernel's factor (s + 14) << 23 is right for


def kernel_decode(words: torch.Tensor, scale: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`_fp4_step`'s decode: int32 words [..., n / 8] and scale bytes [..., n / 32] -> (each
    input's e2m1 value times 2^-14 as float32 [..., n], in input order; each input's factor
    2^(s - 113), float32 [..., n])."""
    spread = (words & 0x07070707) | ((words << 3) & ~0x07070707)
    odd = ((words >> 3) & 0x0E0E0E0E) | (words & ~0x0E0E0E0E)
    halves = (
        (spread << 9) & FP16_PAIR,
        (odd << 8) & FP16_PAIR,
        (spread << 1) & FP16_PAIR,
        odd & FP16_PAIR,
    )
    nibbles = [halves[i % 4] >> (16 if i >= 4 else 0) for i in range(8)]  # nibble i of a word
    values = torch.stack([n.to(torch.int16).view(torch.float16) for n in nibbles], dim=-1)
    factor = ((scale.to(torch.int32) + 14) << 23).view(torch.float32)
    return values.float().flatten(-2), factor.repeat_interleave(fp4.FP4_BLOCK, dim=-1)


def test_decode_formula_is_the_reference_bit_for_bit() -> None:
    """Every byte (so every code in both nibbles of a byte) at every byte offset of a word (so
    in every nibble of a word), under every scale byte 0..240, each row one scale; the kernel's
    three roundings: the float32 product (then x's dtype: fp16), and for bf16 the unit value
    and the factor each rounded to bf16, then multiplied in bf16. (On the GPU a bf16 multiply
    may flush subnormal results: only scale bytes 0 and 1, scales under 2^-125, make any.)"""
    codes = torch.arange(256, dtype=torch.uint8)  # byte b: low nibble b & 15, high b >> 4
    scales = torch.arange(MAX_SCALE + 1, dtype=torch.uint8)
    rows = torch.stack([codes.roll(r) for r in range(4)])  # [4, 256 bytes = 512 inputs]
    packed = rows.repeat(len(scales), 1)
    scale = scales.repeat_interleave(4)[:, None].expand(-1, 16).contiguous()
    unit, factor = kernel_decode(packed.view(torch.int32), scale)
    product = unit * factor
    want = fp4.dequantize_fp4(packed, scale, torch.float32)
    assert torch.equal(product.view(torch.int32), want.view(torch.int32))  # signed zeros too
    assert torch.equal(product.half(), fp4.dequantize_fp4(packed, scale, torch.float16))
    bf16 = unit.bfloat16() * factor.bfloat16()
    assert torch.equal(bf16, fp4.dequantize_fp4(packed, scale, torch.bfloat16))


BF16_PAIR = 0x81C081C0 - (1 << 32)
HIGH_SIGNS = 0x88008800 - (1 << 32)
# fp4_decode.SCALE_BYTES (that module needs Triton; this test does not): from the smallest scale
# whose products are normal bf16s to the largest a checkpoint may carry.
BF16_SCALES = (18, fp4.MAX_SCALE_BYTE)


def kernel_decode_bf16(words: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """`_fp4_step`'s decode for bf16 rows: each input's e2m1 value times 2^-126 as bf16 bits,
    times the factor 2^(s - 17) in bf16 (one rounding, as the packed multiply), then 2^16 (the
    reduction's scale back), as float32 [..., n] in input order."""
    low = (words & 0x00770077) | ((words << 6) & ~0x00770077)
    high = (words & HIGH_SIGNS) | ((words >> 6) & ~HIGH_SIGNS)
    halves = (
        (low << 6) & BF16_PAIR,
        (low << 2) & BF16_PAIR,
        (high << 4) & BF16_PAIR,
        high & BF16_PAIR,
    )
    nibbles = [halves[i % 4] >> (16 if i >= 4 else 0) for i in range(8)]
    unit = torch.stack([n.to(torch.int16).view(torch.bfloat16) for n in nibbles], dim=-1)
    factor = ((scale.to(torch.int32) + 126 - 16) << 7).to(torch.int16).view(torch.bfloat16)
    factor = factor.repeat_interleave(fp4.FP4_BLOCK, dim=-1)
    return (unit.flatten(-2) * factor).float() * 2.0**16


def test_bf16_decode_formula_is_the_reference_bit_for_bit() -> None:
    """The bf16 rows' decode (its own bit moves, and a factor kept in bf16's range by taking the
    weights 2^-16 small): every byte at every byte offset under every scale byte it takes, the
    reference's bf16 weights, signed zeros and the subnormal 0.5 codes included."""
    codes = torch.arange(256, dtype=torch.uint8)
    scales = torch.arange(BF16_SCALES[0], BF16_SCALES[1] + 1, dtype=torch.uint8)
    rows = torch.stack([codes.roll(r) for r in range(4)])
    packed = rows.repeat(len(scales), 1)
    scale = scales.repeat_interleave(4)[:, None].expand(-1, 16).contiguous()
    got = kernel_decode_bf16(packed.view(torch.int32), scale)
    want = fp4.dequantize_fp4(packed, scale, torch.bfloat16).float()
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))


INTERPRETED_CASES = """
import torch
from afdserve.kernels.reference import fp4
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.moe import fp4_decode as k
from afdserve.kernels.triton import counters

def experts(e, rows_out, cols_in, gen, low, high):
    packed = torch.randint(0, 256, (e, rows_out, cols_in // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(low, high + 1, (e, rows_out, cols_in // 32), dtype=torch.uint8,
                          generator=gen)
    return packed, scale

def check(rows, dtype, tiles, limit, seed, rtol, e=4, dims=(64, 64)):
    (hidden, inter), top_k = dims, 2
    gen = torch.Generator().manual_seed(seed)
    # Scales 2^-17..2^-5 around the 1 / sqrt(64) a weight would have: both dots stay O(1).
    gate_up = experts(e, 2 * inter, hidden, gen, 110, 122)
    down = experts(e, hidden, inter, gen, 110, 122)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    ids = torch.rand(rows, e, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(rows, top_k, generator=gen)
    out = k.moe_experts(x, ids, weights, gate_up, down, limit, lambda pairs: tiles)
    w13 = fp4.dequantize_fp4(*gate_up, torch.float32)
    w2 = fp4.dequantize_fp4(*down, torch.float32)
    ref = reference.moe_experts(x.float(), ids, weights, w13, w2, limit)
    err = float((out.float() - ref).norm() / ref.norm())
    assert out.dtype == dtype and err < rtol, (rows, dtype, tiles, err)
    return err

T = k.Tiles
for rows, dtype, tiles, limit, rtol, *e in [
    (3, torch.float32, T(32, 32, k_block=256), 10.0, 1e-6),  # K step: the whole dim (64)
    (3, torch.float32, T(32, 64, k_block=64, weights_left=False), 10.0, 1e-6),
    (5, torch.float32, T(16, 16, k_block=64, rows=16), 1.0, 1e-6),  # the clamp bites
    (9, torch.float32, T(64, 32, k_block=64, rows=32), None, 1e-6),  # no clamp, 32-row tiles
    (3, torch.float16, T(32, 32), 10.0, 2e-3),  # h in fp16
    (3, torch.float32, T(32, 32), 10.0, 1e-6, 16),  # fewer pairs than experts: one per pair
    (40, torch.float32, T(32, 32), 10.0, 1e-6, 128),  # the same over two chunks of the pair list
    (3, torch.float32, T(128, 128, k_block=64), 10.0, 1e-6),  # columns past the dims
    (k.MAX_PAIRS // 2 + 3, torch.float32, T(32, 32), 10.0, 1e-6),  # 2 chunks, many tiles
]:
    print(rows, dtype, tiles, check(rows, dtype, tiles, limit, rows, rtol, *e))
# K splits (Tiles.splits): each tile's last split sums the partials; dims of 256 are 4 steps of
# 64, so 3 splits take 2 + 2 and 8 take 4 of one step. An expert with more pairs than a tile
# (40 rows over 4 experts, 16-row tiles), fewer pairs than experts, the fp16 h, and a launch run
# twice (its counters left at zero).
for rows, dtype, tiles, limit, rtol, *e in [
    (3, torch.float32, T(32, 32, k_block=64, splits=2), 10.0, 1e-6, 4, (256, 256)),
    (3, torch.float32, T(32, 64, k_block=64, splits=3), 1.0, 1e-6, 16, (256, 256)),
    (40, torch.float32, T(32, 32, k_block=64, splits=8), 10.0, 1e-6, 4, (256, 256)),
    (3, torch.float16, T(32, 32, k_block=64, splits=4), 10.0, 2e-3, 4, (256, 256)),
]:
    for _ in range(2):
        print("split", tiles, check(rows, dtype, tiles, limit, rows, rtol, *e))
        assert counters._COUNTERS and all(not c.any() for c in counters._COUNTERS.values())
# One dot a K step (Tiles.one_dot): float32 and fp16 rows, with a K tail, with a split.
for rows, dtype, tiles, rtol, dims in [
    (3, torch.float32, T(32, 32, k_block=64, one_dot=True), 1e-6, (64, 64)),
    (9, torch.float32, T(64, 32, k_block=128, rows=32, one_dot=True), 1e-6, (256, 128)),
    (3, torch.float16, T(32, 32, k_block=128, one_dot=True), 2e-3, (256, 128)),
    (5, torch.float32, T(32, 64, k_block=128, one_dot=True), 1e-6, (192, 320)),
    (5, torch.float32, T(32, 64, k_block=128, splits=2, one_dot=True), 1e-6, (192, 320)),
]:
    print("one dot", tiles, check(rows, dtype, tiles, 10.0, rows, rtol, 4, dims))
# K tails (k_steps): 192 = 128 + 64 and 320 = 2 x 128 + 64, both kernels; the weights as the B
# operand take no tail (wrong when compiled for the GPU): refused by name.
for tiles in (T(32, 64, k_block=128), T(32, 64, k_block=256)):
    print("tail", tiles, check(5, torch.float32, tiles, 10.0, 7, 1e-6, dims=(192, 320)))
# A split reduction with the tail in its last split: 320 = 2 x 128 + 64, two splits.
tiles = T(32, 64, k_block=128, splits=2)
print("tail", check(5, torch.float32, tiles, 10.0, 7, 1e-6, 4, (192, 320)))
try:
    check(5, torch.float32, T(32, 64, k_block=128, weights_left=False), 10.0, 7, 1, dims=(192, 320))
except ValueError as e:
    assert "B operand over dims [192, 320]" in str(e), e
else:
    raise AssertionError("a B-operand launch with a K tail ran")
"""


def test_kernels_under_the_interpreter() -> None:
    # Before 3.7 the interpreter cannot run the kernels' loop over an expert's pair tiles; there
    # the compiled kernels are checked on the GPU instead (tests/gpu/test_fp4_moe.py).
    run = run_interpreted(
        INTERPRETED_CASES, timeout=300, min_triton=(3, 7), env={"TRITON_DEFAULT_FP_FUSION": "1"}
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("tail ") == 3, run.stdout
    assert run.stdout.count("split ") == 8, run.stdout
    assert run.stdout.count("one dot ") == 5, run.stdout
