"""The Gated DeltaNet hybrids' norms in one launch (kernels/triton/norm.py `hybrid_norm`) under
Triton's interpreter (TRITON_INTERPRET=1, numpy) on CPU, against their torch forms
(kernels/reference/layers.py): zero-centred alone, after the residual add (the sum returned too),
over a strided view of heads (q's half of q_proj's rows); gated by silu(z) with z a strided view;
widths a power of two and not. float32 exact to rounding, float16 within one step of its last bit
(the kernel divides by sqrt where torch takes rsqrt; the interpreter truncates where a GPU rounds).
In a subprocess because the variable must be set before any @triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.triton import norm as triton_norm


def close(got, want, dtype, label):
    assert got.dtype == want.dtype == dtype and got.shape == want.shape, label
    tol = 1e-6 if dtype == torch.float32 else 2.0**-9
    err = ((got.float() - want.float()).abs() / (want.float().abs() + 1e-3)).max()
    assert float(err) <= tol, (label, float(err))


for dtype in (torch.float32, torch.float16):
    for rows, heads, width in [(3, 1, 64), (5, 4, 96), (2, 2, 256)]:
        gen = torch.Generator().manual_seed(rows * width)
        both = (torch.randn(rows, heads, 2 * width, generator=gen) * 3).to(dtype)
        x = both[..., :width]  # a strided view, as q beside its gate
        weight = (torch.randn(width, generator=gen) * 0.2).to(dtype)
        label = ("zero", dtype, rows, heads, width)
        got, summed = triton_norm.hybrid_norm(x, weight, 1e-6)
        assert summed is None
        close(got, reference.zero_centred_rms_norm(x, weight, 1e-6), dtype, label)
        h = x.reshape(rows, heads * width).contiguous()
        delta = torch.randn(h.shape, generator=gen).to(dtype)
        wide = (torch.randn(heads * width, generator=gen) * 0.2).to(dtype)
        got, summed = triton_norm.hybrid_norm(h, wide, 1e-6, delta=delta)
        assert torch.equal(summed, h + delta), label
        close(got, reference.zero_centred_rms_norm(h + delta, wide, 1e-6), dtype, label + ("add",))
        z = both[..., width:]
        got, _ = triton_norm.hybrid_norm(x, weight + 1, 1e-6, z=z)
        close(got, reference.gated_rms_norm(x, z, weight + 1, 1e-6), dtype, label + ("gated",))
        print("norms", label, "ok")

# A weight of another dtype than x's: the gated norm's product in torch's promotion of the two.
gen = torch.Generator().manual_seed(0)
for x_dtype, w_dtype in [(torch.float32, torch.float16), (torch.float16, torch.float32)]:
    x = (torch.randn(4, 96, generator=gen) * 3).to(x_dtype)
    z = torch.randn(4, 96, generator=gen).to(x_dtype)
    weight = (torch.randn(96, generator=gen) + 1).to(w_dtype)
    got, _ = triton_norm.hybrid_norm(x, weight, 1e-6, z=z)
    close(got, reference.gated_rms_norm(x, z, weight, 1e-6), x_dtype, ("mixed", x_dtype, w_dtype))
    print("norms mixed", x_dtype, w_dtype, "ok")
"""


def test_hybrid_norms_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 8, run.stdout
