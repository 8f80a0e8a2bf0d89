"""The FP8 decode expert kernels (kernels/moe/fp8_decode.py) on CPU.

1. `triton_fp8.as_operand`'s exponents, taken from the float32 bits of a row's largest value,
   written again here in torch int32 ops: the w8a8 one is the least power of two that brings
   the value to at most 448 (kernels/fp8.quantize_activations' scale) and the weight-only one
   brings it into [2^13, 2^14), over every exponent the clamps allow, mantissas at and around
   448's (1.75) and random ones.
2. The real kernels under Triton's interpreter (TRITON_INTERPRET=1, numpy), in a subprocess
   because the variable must be set before any @triton.jit function is defined, both operand
   orders: fp16 rows weight-only against `fp8.moe_experts_fp8` (the oracle, float32; the
   kernels' h is fp16, hence the tolerance), at Qwen3-like dims, dims that no tile divides
   (columns past the last read its weights) with K steps of 16, and more pairs than experts
   (programs by expert). w8a8 (fp16 rows quantized to e4m3, fp8 dots) only one order against
   the other: the interpreter's float -> e4m3 rounding is not torch's (so not the oracle's),
   and bf16 it computes wrongly, so those are tests/gpu/test_fp8_kernels.py's.

Runtime: about half a minute; the second part needs Triton (skipped where it is not
installed) whose interpreter takes a loop bound computed in the kernel: 3.9's does, 3.6's does
not (nor does it run test_fp4_kernel_interpret.py's cases)."""

from __future__ import annotations

import torch

from tests.kernels.interpret import run_interpreted


def w8a8_shift(amax: torch.Tensor) -> torch.Tensor:
    bits = amax.float().view(torch.int32)
    return (bits >> 23) - 135 + ((bits & 0x7FFFFF) > 0x600000).to(torch.int32)


def weight_only_shift(amax: torch.Tensor) -> torch.Tensor:
    return (amax.float().view(torch.int32) >> 23) - 140


def test_exponents_from_bits_are_the_least_that_fit() -> None:
    # amax >= 1e-30 (the clamp); below 2^127, where the oracle's rounded value would overflow.
    exponents = torch.arange(-99, 127, dtype=torch.float64)
    mantissas = torch.tensor([1.0, 1.5, 1.75 - 2**-23, 1.75, 1.75 + 2**-23, 2 - 2**-23])
    some = 1 + torch.rand(200, generator=torch.Generator().manual_seed(0))
    amax = (torch.cat([mantissas, some]).double()[:, None] * torch.exp2(exponents)).float()
    amax = amax.flatten()
    shift = w8a8_shift(amax).double()
    scaled = amax.double() / torch.exp2(shift)  # exact: a power of two
    assert (scaled <= 448).all() and (scaled * 2 > 448).all()  # the least that fits
    # The oracle's scale for a group whose largest value is amax.
    groups = amax[:, None] * torch.linspace(-1, 1, 128)[None, :]
    assert torch.equal(groups.abs().amax(dim=1), amax)
    from afdserve.kernels.reference import fp8

    q = fp8.quantize_activations(groups, 128)
    want = (groups.double() / torch.exp2(shift)[:, None]).float().to(fp8.FP8_DTYPE).double()
    assert torch.equal(q.double(), want * torch.exp2(shift)[:, None])
    big = amax >= 1e-20  # the weight-only clamp
    scaled = amax[big].double() / torch.exp2(weight_only_shift(amax[big]).double())
    assert (scaled >= 2**13).all() and (scaled < 2**14).all()


INTERPRETED_CASES = """
import torch
from afdserve.kernels.reference import fp8
from afdserve.kernels.moe import fp8_decode as k
from afdserve.model.layers.fp8 import quantize_weight

BLOCK = (128, 128)

def case(rows, e, hidden, inter, top_k, seed):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=gen).half()
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) * inter**-0.5
    ids = torch.rand(rows, e, generator=gen).topk(top_k, dim=-1).indices
    weights = torch.rand(rows, top_k, generator=gen)
    return x, ids, weights, quantize_weight(w13, True, BLOCK), quantize_weight(w2, False, BLOCK)

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

for rows, e, hidden, inter, top_k in [
    (1, 16, 256, 128, 8),  # a decode batch: 8 pairs, a program per pair, 8-row tiles
    (1, 8, 144, 80, 4),  # no tile divides the dims; K steps of 16; partial scale blocks
    (3, 8, 256, 128, 4),  # 12 pairs over 8 experts: a program per expert, 16-row tiles
]:
    x, ids, weights, gu, dn = case(rows, e, hidden, inter, top_k, rows + hidden)
    pairs = ids.numel()
    ref = fp8.moe_experts_fp8(x.float(), ids, weights, gu, dn, BLOCK)
    out = {}
    for a8 in (False, True):
        for left in (True, False):
            tiles = k.tiles_for(pairs, left)
            out[a8, left] = k.moe_experts(x, ids, weights, gu, dn, a8=a8, tiles=tiles)
            assert out[a8, left].dtype == x.dtype and out[a8, left].shape == x.shape
        err = rel(out[a8, True], out[a8, False])
        print(rows, hidden, inter, "a8" if a8 else "weight-only", "left vs right", err)
        assert err < 1e-4, err
    for left in (True, False):
        err = rel(out[False, left], ref)
        print(rows, hidden, inter, "left" if left else "right", "against the oracle", err)
        assert err < 2e-3, err
"""


def test_decode_kernels_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600, min_triton=(3, 7))
    assert run.returncode == 0, run.stdout + run.stderr
