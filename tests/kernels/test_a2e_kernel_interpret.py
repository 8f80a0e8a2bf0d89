"""The fp8 A2E kernels (kernels/triton/a2e.py) on CPU under Triton's interpreter
(TRITON_INTERPRET=1, numpy), bit for bit against a2e.py's torch functions, the format's definition.

The interpreter runs in a subprocess, as the variable must be set before any @triton.jit function
is defined, from a script file (Triton reads a kernel's source, which `python -c` has not got).

1. `_e4m3_grid`, the kernels' rounding to e4m3 (in float32), over every e4m3 value, the midpoint
   between each two neighbours and the float32 values either side of it, both signs, float32
   subnormals and a million random float32 values of [0, 448]: torch's cast to float8_e4m3fn
   (`.float()` for the float32 result, the bytes for the kernels' cast after it).
2. The three kernels on float32 and float16 rows, hidden 1, 64, 127, 128, 200 and 2048 (partial
   and single groups): random rows, a zero row, a row of -0.0, a row with outliers, a row of tiny
   values (float32: scales below float32's normals), pad rows (route id -1, int64 and int32 ids),
   a row stride wider than the row, and no rows at all. Quantize: q's bytes and the scales' bits;
   dequantize and the fused round trip: the output's bits, in float32 and float16.
3. Rows with inf and NaN: the scales bit for bit, q equal where torch's q is not NaN, the round
   trip NaN where torch's is and equal elsewhere. (The interpreter's fp8 cast writes a NaN as
   0x7C, which is 384.0, where torch writes 0x7F: q's NaNs are not compared here, and the GPU's
   are in tests/gpu/test_a2e_kernels.py.)

bfloat16 is tests/gpu/test_a2e_kernels.py's: the interpreter computes bf16 wrongly.
Runtime: a few seconds; needs Triton (skipped where it is not installed)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

CASES = """
import torch
import triton
import triton.language as tl

from afdserve.kernels import a2e

from afdserve.kernels.triton import a2e as k

INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t):
    return t.contiguous().view(INT[t.element_size()])


def same(got, want, what):
    assert got.dtype == want.dtype and got.shape == want.shape, (what, got.shape, want.shape)
    assert torch.equal(bits(got), bits(want)), (what, (bits(got) != bits(want)).nonzero()[:5])


@triton.jit
def grid_kernel(Y, R, Q, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    r = k._e4m3_grid(tl.load(Y + offs, mask=mask))
    tl.store(R + offs, r, mask=mask)
    tl.store(Q + offs, r.to(tl.float8e4nv, fp_downcast_rounding="rtne"), mask=mask)


def check_grid():
    codes = torch.arange(256, dtype=torch.uint8).view(torch.float8_e4m3fn).float()
    values = codes[codes.isfinite() & (codes >= 0)].sort().values.unique()  # 0 .. 448
    mids = (values[1:] + values[:-1]) / 2  # exact in float32
    near = [torch.nextafter(t, t.new_full((), d)) for t in (values, mids) for d in (0.0, 1e9)]
    sub = torch.tensor([1e-45, 1e-40, 1.1754942e-38, 1.1754944e-38])  # float32 subnormals
    gen = torch.Generator().manual_seed(0)
    spread = torch.randint(0, 0x43E00001, (1 << 20,), generator=gen, dtype=torch.int32)
    y = torch.cat([values, mids, *near, sub, spread.view(torch.float32)]).clamp(max=448.0)
    y = torch.cat([y, -y])
    r, q = torch.empty_like(y), torch.empty(y.shape, dtype=torch.float8_e4m3fn)
    grid_kernel[(triton.cdiv(y.numel(), 4096),)](y, r, q, y.numel(), BLOCK=4096)
    same(r, y.to(torch.float8_e4m3fn).float(), "grid")
    same(q, y.to(torch.float8_e4m3fn), "grid cast")
    print("grid", y.numel(), "values")


def rows_of(hidden, dtype, gen):
    x = torch.randn(8, hidden + 16, generator=gen)[:, :hidden] * 3  # row stride hidden + 16
    x[1] = 0
    x[2] = -0.0
    x[3, ::37] = 3000.0  # outliers
    x[4] *= 1e-6 if dtype == torch.float16 else 1e-38  # fp16 subnormals, float32 tiny scales
    x[6, ::5] = -0.0
    return x.to(dtype) if dtype != torch.float32 else x


def check_rows(x, ids, what):
    q_want, s_want = a2e.quantize_rows_torch(x)
    q, s = k.quantize_rows(x)
    same(q, q_want, ("q", what))
    same(s, s_want, ("scales", what))
    for out in (torch.float32, torch.float16):
        want = a2e.dequantize_rows_torch(q_want, s_want, out)
        same(k.dequantize_rows(q_want, s_want, out), want, ("dequantize", out, what))
        same(k.roundtrip(x, out), want, ("roundtrip", out, what))
        zeroed = a2e.dequantize_rows_torch(*a2e.quantize_rows_torch(a2e.pad_zeroed(x, ids)), out)
        same(k.roundtrip(x, out, ids), zeroed, ("ffn rows", out, what))


def check_kernels():
    gen = torch.Generator().manual_seed(1)
    for hidden in (1, 64, 127, 128, 200, 2048):
        for dtype in (torch.float32, torch.float16):
            x = rows_of(hidden, dtype, gen)
            ids = torch.tensor([-1, 3, 1, 4, 1, -1, 5, 9])
            check_rows(x, ids, (hidden, dtype))
            check_rows(x.contiguous(), ids.int(), (hidden, dtype, "contiguous, int32 ids"))
            check_rows(x[:0], ids[:0], (hidden, dtype, "no rows"))
            check_rows(x[5:6], ids[5:6], (hidden, dtype, "one pad row"))
    print("kernels")


def check_non_finite():
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    x[0, 3], x[1, 130], x[2, 7] = float("nan"), float("inf"), -float("inf")
    q_want, s_want = a2e.quantize_rows_torch(x)
    q, s = k.quantize_rows(x)
    same(s, s_want, "non-finite scales")
    nan = q_want.float().isnan()  # the interpreter's NaN bytes are wrong (0x7C, 384.0)
    same(q.view(torch.uint8)[~nan], q_want.view(torch.uint8)[~nan], "non-finite q")
    for out in (torch.float32, torch.float16):
        want, got = a2e.dequantize_rows_torch(q_want, s_want, out), k.roundtrip(x, out)
        assert torch.equal(got.isnan(), want.isnan())
        same(got[~want.isnan()], want[~want.isnan()], ("non-finite roundtrip", out))
    print("non-finite")


check_grid()
check_kernels()
check_non_finite()
"""


def test_kernels_under_the_interpreter(tmp_path: Path) -> None:
    pytest.importorskip("triton")
    script = tmp_path / "a2e_cases.py"
    script.write_text(CASES)
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run(
        [sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300
    )
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.split()[-1:] == ["non-finite"], run.stdout
