"""The grouped FP8 expert kernels' down tiles over several scale blocks (kernels/
triton_grouped_moe.py, weights left) under Triton's interpreter (TRITON_INTERPRET=1, numpy), on
CPU: 256- and 512-column down tiles, each row scaled by its own block's scale, give the
128-column tiles' outputs bit for bit with w8a8 (the same products per block, summed in the same
order), and agree with them and with the weight-only oracle (`fp8.moe_experts_fp8`, float32)
weight-only. Dims where the last tile runs past the hidden size (its columns clamp to the last,
its scale rows to the last block), a partial last block, several tiles of one expert, pad pairs.
fp16 rows (the interpreter computes bf16 wrongly; w8a8 its e4m3 rounding is not torch's, so w8a8
is checked against the 128-column tiles only: tests/gpu/test_fp8_kernels.py has the oracle).
In a subprocess because the variable must be set before any @triton.jit function is defined;
needs Triton 3.7 or later, as tests/kernels/test_absent_pairs_interpret.py says."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.reference import fp8
from afdserve.kernels.moe import grouped as g
from afdserve.model.layers.fp8 import quantize_weight

BLOCK = (128, 128)

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

for rows, e, hidden, inter, top_k in [(24, 8, 256, 256, 2), (40, 4, 384, 384, 2),
                                      (9, 16, 144, 80, 4), (9, 16, 208, 128, 4)]:
    gen = torch.Generator().manual_seed(rows + hidden)
    x = torch.randn(rows, hidden, generator=gen).half()
    w13 = torch.randn(e, 2 * inter, hidden, generator=gen) * hidden**-0.5
    w2 = torch.randn(e, hidden, inter, generator=gen) * inter**-0.5
    ids = torch.rand(rows, e, generator=gen).topk(top_k, dim=-1).indices
    ids[::3, -1] = -1
    weights = torch.rand(rows, top_k, generator=gen)
    gu, dn = quantize_weight(w13, True, BLOCK), quantize_weight(w2, False, BLOCK)
    ref = fp8.moe_experts_fp8(x.float(), ids, weights, gu, dn, BLOCK)
    for a8 in (True, False):
        out = {c: g.moe_experts(x, ids, weights, gu[0], dn[0], (gu[1], dn[1]), a8=a8,
                                weights_left=True, launch=(128, c, 4, 3))
               for c in (128, 256, 512)}
        for c in (256, 512):
            if a8:
                assert torch.equal(out[c], out[128]), (rows, hidden, c)
            else:
                assert rel(out[c], out[128]) < 1e-4, (rows, hidden, c, rel(out[c], out[128]))
                assert rel(out[c], ref) < 2e-3, (rows, hidden, c, rel(out[c], ref))
        print(rows, hidden, "a8" if a8 else "weight-only", "ok")
"""


def test_down_tiles_over_several_scale_blocks_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=600, min_triton=(3, 7))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 8, run.stdout
