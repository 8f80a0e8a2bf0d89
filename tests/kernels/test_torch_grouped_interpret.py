"""The prefill experts' path (kernels/moe/torch_grouped.py: torch's grouped GEMM, the activation
and the weighted sum of each row's pairs as Triton launches) under Triton's interpreter
(TRITON_INTERPRET=1, numpy), on CPU, where torch runs grouped_mm too.

Against the float64 reference with pairs of no expert (id -1, or an id past the shard's experts)
in every position: a row's first pair, a whole row (exactly zero); x column-major gives the
same bits. And the sum alone, reading y
through each pair's slot with its weight, against the same sum in float64 (float32 y: to float32
rounding). In a subprocess because the variable must be set before any @triton.jit function is
defined (tests/kernels/interpret.py).
"""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.moe import decode, torch_grouped
from afdserve.kernels.reference import layers as reference

def rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())

for rows, e, hidden, inter, k in [(40, 8, 64, 32, 2), (33, 16, 128, 64, 4), (3, 4, 64, 32, 4)]:
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, hidden, generator=gen).bfloat16()
    w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5).bfloat16()
    w2 = (torch.randn(e, hidden, inter, generator=gen) * inter**-0.5).bfloat16()
    ids = torch.rand(rows, e, generator=gen).topk(k, dim=-1).indices
    ids[::3, 0] = -1
    ids[1, -1] = e  # an expert past this shard's: no expert here either
    ids[-1, :] = -1
    weights = torch.rand(rows, k, generator=gen)
    got = torch_grouped.moe_experts(x, ids, weights, w13, w2)
    kept = ids.masked_fill(ids >= e, -1)
    want = reference.moe_experts(x.double(), kept, weights.double(), w13.double(), w2.double())
    err = rel(got, want)
    print(rows, err)
    # bf16 outputs; the interpreter truncates float32 -> bf16 casts (tests/kernels/interpret.py)
    assert got.shape == x.shape and got.dtype == torch.bfloat16 and err < 2e-2, (rows, err)
    assert torch.equal(got[-1], torch.zeros_like(got[-1])), rows
    column_major = x.t().contiguous().t()  # the same rows, strides (1, rows)
    assert torch.equal(torch_grouped.moe_experts(column_major, ids, weights, w13, w2), got), rows

rows, k, hidden = 9, 3, 700  # hidden past one program's 512 columns, masked
gen = torch.Generator().manual_seed(0)
y = torch.randn(rows * k + 4, hidden, generator=gen)
ids = torch.randint(0, 5, (rows * k,), generator=gen)
ids[4], ids[7] = -1, 9
slots = torch.randperm(rows * k + 4, generator=gen)[: rows * k]
w = torch.rand(rows * k, generator=gen)
out = decode.sum_pairs(y, ids, torch.empty(rows, hidden), 5, slots=slots, weights=w)
routed = ((ids >= 0) & (ids < 5)).double()
want = (y[slots].double() * (w.double() * routed)[:, None]).view(rows, k, hidden).sum(1)
err = float((out.double() - want).abs().max())
print("sum", err)
assert err < 1e-5, err
"""


def test_prefill_experts_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr


def test_group_pairs_against_its_definition() -> None:
    """The grouping alone (plain torch, any device): order the stable sort of the pairs by
    expert with absent ids last, offsets each expert's cumulative count, slots the inverse of
    the order; int16 keys below 2^15 experts, the ids' own past it."""
    import pytest

    pytest.importorskip("triton")  # the module imports its Triton launches
    import torch

    from afdserve.kernels.moe.torch_grouped import group_pairs

    gen = torch.Generator().manual_seed(0)
    for experts in (1, 8, 128, 300, 2**15):
        for n in (0, 1, 7, 1000, 65536):
            ids = torch.randint(-1, experts + 2, (n,), generator=gen)
            keys = torch.where((ids < 0) | (ids >= experts), experts, ids)
            order, offsets, slots = group_pairs(ids, experts)
            assert torch.equal(order, torch.argsort(keys, stable=True))
            counts = torch.bincount(keys, minlength=experts + 1)[:experts]
            assert offsets.dtype == torch.int32
            assert torch.equal(offsets, torch.cumsum(counts, 0).to(torch.int32))
            assert torch.equal(slots[order], torch.arange(n))
