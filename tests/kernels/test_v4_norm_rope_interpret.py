"""DeepSeek-V4's per-head norm and rotary (kernels/triton/v4_norm_rope.py) under Triton's
interpreter (TRITON_INTERPRET=1, numpy) on CPU, against the torch forms it replaces on CUDA
(model/families/deepseek_v4/: `unweighted_rms_norm`, `v4_rms_norm`, `rope_tail`): every use in the
model (the q heads: unweighted norm and rotary; the KV row: weighted and rotary; the q residual:
weighted only; the indexer's queries: rotary only; the output: rotary undone), one row (batch 1)
and odd row counts, 1, 4 and 3 heads, dims 16, 80 and 512 with 4, 20 and 32 rotated pairs;
float32 and float16 (the interpreter computes bf16 wrongly); the KV row and the q residual as
column slices of a wider output, as the packed q_a/kv GEMM hands them. In a subprocess because
the variable must be set before any @triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.triton import v4_norm_rope as triton_v4
from afdserve.model.families.deepseek_v4.attention import rope_tail
from afdserve.model.families.deepseek_v4.mhc import unweighted_rms_norm, v4_rms_norm

USES = {  # name -> (norm: None, "unweighted" or "weighted"; rotated?; rotated back?)
    "q": ("unweighted", True, False),
    "kv": ("weighted", True, False),
    "q_residual": ("weighted", False, False),
    "index_q": (None, True, False),
    "output": (None, True, True),
}
for rows, heads, dim, pairs in [(1, 4, 16, 4), (3, 1, 80, 20), (5, 3, 512, 32)]:
    for dtype in (torch.float32, torch.float16):
        for use, (norm, rotated, back) in USES.items():
            gen = torch.Generator().manual_seed(rows + heads + dim)
            x = (torch.randn(rows, heads, dim, generator=gen) * 3).to(dtype)
            if use in ("kv", "q_residual"):  # as the model hands them: slices of a packed GEMM
                packed = torch.zeros(rows, 8 + heads * dim + 24, dtype=dtype)
                packed[:, 8 : 8 + heads * dim] = x.flatten(1)
                x = packed[:, 8 : 8 + heads * dim].view(rows, heads, dim)
            weight = torch.rand(dim, generator=gen) + 0.5
            angle = torch.rand(rows, pairs, generator=gen) * 50
            cos, sin = angle.cos() * 1.1, angle.sin() * 1.1
            want, spec = x, None
            if norm == "unweighted":
                want, spec = unweighted_rms_norm(x, 1e-6), (None, 1e-6)
            elif norm == "weighted":
                want, spec = v4_rms_norm(x, weight, 1e-6), (weight, 1e-6)
            if rotated:
                want = rope_tail(want, cos, -sin if back else sin)
            got = triton_v4.norm_rope(x, spec, (cos, sin) if rotated else None, back)
            err = float((got.double() - want.double()).norm() / want.double().norm())
            label = (use, rows, heads, dim, dtype)
            assert got.dtype == dtype and err < (1e-6 if dtype == torch.float32 else 1e-3), (
                label, err)
            print("norm_rope", label, "ok")
"""


def test_fused_v4_norm_rope_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 30, run.stdout
