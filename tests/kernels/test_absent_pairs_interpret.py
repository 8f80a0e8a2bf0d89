"""Pairs routed to no expert here (id -1: a pad row, or an expert another rank holds) under
Triton's interpreter (TRITON_INTERPRET=1, numpy), on CPU.

The decode expert kernels (kernels/moe/decode.py, triton_fp8_moe.py) skip such pairs inside the
kernel and the shared sum (`triton_moe.sum_pairs`) leaves them out, as the grouped kernels
(triton_grouped_moe.py) do; nothing maps them to a real expert beforehand. Each path, with pads
in every position (a row's first pair, a whole row, the only pair of an expert's slot), against
the reference that drops them (`reference.moe_experts`, `fp8.moe_experts_fp8`): fp16 rows (the
interpreter computes bf16 wrongly), FP8 weight-only and both operand orders. A row of pads alone
comes out exactly zero. In a subprocess because the variable must be set before any
@triton.jit function is defined; needs Triton 3.7 or later (3.6's interpreter cannot run a loop
bounded by a reduced tensor; there tests/gpu/test_fp8_kernels.py checks the compiled kernels).
"""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.reference import fp8
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.moe import fp8_decode as triton_fp8_moe
from afdserve.kernels.moe import grouped as triton_grouped_moe
from afdserve.kernels.moe import decode as triton_moe
from afdserve.model.layers.fp8 import quantize_weight

BLOCK = (128, 128)

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

for rows, e, hidden, inter, top_k in [(1, 16, 256, 128, 8), (2, 4, 64, 32, 2), (3, 8, 64, 32, 4),
                                      (40, 8, 64, 32, 2)]:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).half()
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) * inter**-0.5
    ids = torch.rand(rows, e, generator=gen).topk(top_k, dim=-1).indices
    ids[::2, 0] = -1
    if rows > 1:
        ids[-1, :] = -1
    weights = torch.rand(rows, top_k, generator=gen)
    pairs = ids.numel()
    ref = reference.moe_experts(x.float(), ids, weights, w13.half().float(), w2.half().float())
    outs = {"grouped": triton_grouped_moe.moe_experts(x, ids, weights, w13.half(), w2.half())}
    if pairs <= triton_moe.MAX_PAIRS:
        outs["decode"] = triton_moe.moe_experts(x, ids, weights, w13.half(), w2.half())
    gu, dn = quantize_weight(w13, True, BLOCK), quantize_weight(w2, False, BLOCK)
    ref8 = fp8.moe_experts_fp8(x.float(), ids, weights, gu, dn, BLOCK)
    for left in (True, False):
        outs["fp8 grouped", left] = triton_grouped_moe.moe_experts(
            x, ids, weights, gu[0], dn[0], (gu[1], dn[1]), a8=False, weights_left=left)
        if pairs <= triton_fp8_moe.MAX_PAIRS:
            tiles = triton_fp8_moe.tiles_for(pairs, left)
            outs["fp8 decode", left] = triton_fp8_moe.moe_experts(x, ids, weights, gu, dn,
                                                                  a8=False, tiles=tiles)
    for name, out in outs.items():
        want = ref8 if "fp8" in str(name) else ref
        err = rel(out, want)
        print(rows, name, err)
        assert out.shape == x.shape and err < 2e-3, (rows, name, err)
        if rows > 1:
            assert torch.equal(out[-1], torch.zeros_like(out[-1])), (rows, name)
"""


def test_pairs_of_no_expert_are_skipped_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600, min_triton=(3, 7))
    assert run.returncode == 0, run.stdout + run.stderr
