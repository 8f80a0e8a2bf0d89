"""`ops.dequantize_stack` (FP8 expert stacks to a bf16 copy in one pass over them as one matrix,
the long prefill chunks' path into torch's grouped GEMM) under Triton's interpreter, on CPU:
bit for bit the reference's per-expert dequantization (in float32), gate/up and down stacks,
partial K blocks included; None for the grids it cannot read as one matrix. In a subprocess
because the variable must be set before any @triton.jit function is defined
(tests/kernels/interpret.py)."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels import ops
from afdserve.kernels.reference import fp8

BLOCK = (128, 128)

def stack(experts, n, k, seed):
    gen = torch.Generator().manual_seed(seed)
    pairs = [fp8.quantize_blockwise(torch.randn(n, k, generator=gen) * 3.0, BLOCK)
             for _ in range(experts)]
    return torch.stack([q for q, _ in pairs]), torch.stack([s for _, s in pairs])

for experts, inter, hidden in [(3, 128, 256), (2, 256, 200)]:  # 200: a partial K block
    q13, s13 = stack(experts, 2 * inter, hidden, 1)
    q2, s2 = stack(experts, hidden if hidden % 128 == 0 else 256, inter, 3)
    # float32 out: bit for bit (the interpreter truncates float32 -> bf16 casts where a GPU
    # rounds, tests/kernels/interpret.py; the GPU test checks bf16's bits).
    got13 = ops.dequantize_stack(q13, s13, torch.float32)
    want13 = fp8.dequantize_gate_up(q13, s13, torch.float32, BLOCK)
    assert got13.shape == want13.shape and torch.equal(got13, want13), (experts, inter)
    got2 = ops.dequantize_stack(q2, s2, torch.float32)
    assert torch.equal(got2, fp8.dequantize_blockwise(q2, s2, torch.float32, BLOCK))
    bf16 = ops.dequantize_stack(q2, s2, torch.bfloat16)
    assert bf16.dtype == torch.bfloat16 and torch.allclose(bf16.float(), got2, rtol=2**-7, atol=0)

# Gate/up halves of 96 rows: a grid each (2 block rows for 192 rows), not one matrix's.
q, s = stack(2, 96, 128, 4)
halves = torch.cat([q, q], 1), torch.cat([s, s], 1)
assert ops.dequantize_stack(*halves, torch.bfloat16) is None
q, s = stack(2, 128, 256, 5)
assert ops.dequantize_stack(q.transpose(1, 2), s, torch.bfloat16) is None  # not contiguous
assert ops.dequantize_stack(q, s.double(), torch.bfloat16) is None  # not a float32 grid
print("ok")
"""


def test_fp8_stack_dequantizes_as_the_reference_does():
    run = run_interpreted(INTERPRETED_CASES, timeout=300)
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stderr[-3000:]
