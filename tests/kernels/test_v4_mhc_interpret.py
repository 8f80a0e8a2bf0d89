"""DeepSeek-V4's fused mHC site (kernels/triton/mhc.py) under Triton's interpreter
(TRITON_INTERPRET=1, numpy) on CPU, against the torch path it replaces on CUDA
(model/families/deepseek_v4/mhc.py: `expand`, `HyperConnection`, `v4_rms_norm`): the updated
streams, the normalised collapse, post and comb; and the update alone (`expand`). Cases: one
row, odd row counts (9: two blocks of rows, the second partly masked; 64 to 96: the
block-of-rows kernel, its chunks' loop over column steps), 2, 3 (padded) and 4 streams, widths
under one chunk, not a power of two and over one collapse block, with and without the update
(layer 0), 20 Sinkhorn rounds and one; float32 and float16 (the interpreter computes bf16
wrongly; tests/gpu covers it). In a subprocess because the variable must be set before any
@triton.jit function is defined."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.triton import mhc as triton_mhc
from afdserve.model.families.deepseek_v4.mhc import HyperConnection, expand, v4_rms_norm


def case(rows, n, hidden, dtype, iters, update, seed):
    gen = torch.Generator().manual_seed(seed)
    hc = HyperConnection(hidden, n, iters, 1e-6, 1e-6)
    with torch.no_grad():
        hc.fn.copy_(torch.randn(hc.fn.shape, generator=gen) * (n * hidden) ** -0.5)
        hc.base.copy_(torch.randn(hc.base.shape, generator=gen) * 0.5)
        hc.scale.copy_(torch.rand(3, generator=gen) + 0.5)
    weight = torch.rand(hidden, generator=gen) + 0.5
    h = torch.randn(rows, n, hidden, generator=gen).to(dtype)
    y = post = comb = None
    if update:
        y = torch.randn(rows, hidden, generator=gen).to(dtype)
        post = torch.rand(rows, n, generator=gen) * 2
        comb = torch.rand(rows, n, n, generator=gen)
    with torch.no_grad():
        want_h = h if y is None else expand(h, y, post, comb)
        collapsed, want_post, want_comb = hc(want_h)
        want = (want_h, v4_rms_norm(collapsed, weight, 1e-5), want_post, want_comb)
        got = triton_mhc.hyper_connection(
            h, y, post, comb, hc.fn, hc.base, hc.scale, weight, iters, 1e-6, 1e-6, 1e-5
        )
    tol = 1e-5 if dtype == torch.float32 else 2e-3
    label = (rows, n, hidden, dtype, iters, update)
    for name, g, w in zip(("streams", "x", "post", "comb"), got, want):
        assert g.dtype == w.dtype and g.shape == w.shape, (label, name, g.dtype, g.shape)
        err = float((g.double() - w.double()).norm() / w.double().norm())
        assert err < tol, (label, name, err)
    print("mhc", label, "ok")


CASES = [
    (1, 4, 256, torch.float32, 20, True),
    (1, 4, 96, torch.float16, 20, False),
    (3, 2, 32, torch.float32, 20, False),
    (5, 3, 200, torch.float16, 20, True),
    (9, 2, 1100, torch.float32, 1, True),
    (2, 3, 48, torch.float32, 3, True),
    # From ROWS_KERNEL_FROM rows: the block-of-rows kernel (a partial block, 3 streams padded).
    (70, 3, 200, torch.float16, 20, True),
    (64, 4, 256, torch.float32, 20, False),
    (96, 2, 40, torch.float32, 2, True),
    # Three chunks of ROWS_CHUNK columns, the last partly masked, each in steps of ROWS_STEP.
    (65, 4, 600, torch.float16, 20, True),
]
for i, args in enumerate(CASES):
    case(*args, seed=i)


def expand_case(rows, n, hidden, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    h = torch.randn(rows, n, hidden, generator=gen).to(dtype)
    y = torch.randn(rows, hidden, generator=gen).to(dtype)
    post = torch.rand(rows, n, generator=gen) * 2
    comb = torch.rand(rows, n, n, generator=gen)
    want = expand(h, y, post, comb)
    got = triton_mhc.expand(h, y, post, comb)
    assert got.dtype == want.dtype and got.shape == want.shape
    err = float((got.double() - want.double()).norm() / want.double().norm())
    assert err < (1e-6 if dtype == torch.float32 else 1e-3), (rows, n, hidden, dtype, err)
    print("expand", (rows, n, hidden, dtype), "ok")


# Decode rows (a step of columns a program) and from ROWS_KERNEL_FROM (chunks in steps).
for i, args in enumerate([(1, 4, 256, torch.float32), (5, 3, 200, torch.float16),
                          (70, 4, 600, torch.float16), (64, 2, 40, torch.float32)]):
    expand_case(*args, seed=100 + i)

# The chunks' loop over column steps (the shipped chunk is one step): 128 columns in steps of 32.
shipped = triton_mhc.ROWS_CHUNK, triton_mhc.ROWS_STEP
triton_mhc.ROWS_CHUNK, triton_mhc.ROWS_STEP = 128, 32
case(65, 4, 600, torch.float16, 20, True, seed=50)
case(64, 3, 200, torch.float32, 20, False, seed=51)
expand_case(70, 4, 600, torch.float16, seed=52)
triton_mhc.ROWS_CHUNK, triton_mhc.ROWS_STEP = shipped
"""


def test_fused_mhc_site_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 17, run.stdout
