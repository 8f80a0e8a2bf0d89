"""The fused activation (kernels/triton/swiglu.py) under Triton's interpreter on CPU against
`reference.swiglu`: float32 and float16 rows, strided rows (a row view of a wider tensor), widths
past one program's block, and DeepSeek-V4's clamps (values beyond the limit on both sides); it
compiles for the H200 (sm_90) with and without the clamps. In a subprocess: the variable must be
set before any @triton.jit function is defined."""

from __future__ import annotations

import pytest

from tests.kernels.interpret import run_interpreted

INTERPRETED_CASES = """
import torch
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.triton import swiglu as triton_swiglu

for rows, width, limit, dtype in [(3, 40, None, torch.float32), (5, 2500, 10.0, torch.float32),
                                  (2, 1030, None, torch.float16), (4, 96, 7.0, torch.float16)]:
    gen = torch.Generator().manual_seed(rows + width)
    wide = (torch.randn(rows, 2 * width + 8, generator=gen) * 6).to(dtype)
    gate, up = wide[:, :width], wide[:, width + 8:]  # row views: strided, not contiguous
    assert triton_swiglu.supports(gate, up) and not gate.is_contiguous()
    got = triton_swiglu.swiglu(gate, up, limit)
    want = reference.swiglu(gate, up, limit)
    if limit is not None:
        assert bool((gate > limit).any()) and bool((up < -limit).any())
    tol = 1e-6 if dtype == torch.float32 else 1e-3
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    print("swiglu", rows, width, limit, dtype, "ok")
"""


def test_fused_swiglu_under_the_interpreter() -> None:
    run = run_interpreted(INTERPRETED_CASES, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count(" ok") == 4, run.stdout


@pytest.mark.parametrize("limit", [False, True])
def test_swiglu_kernel_compiles_for_sm90(limit) -> None:
    pytest.importorskip("triton")
    from afdserve.kernels.triton import swiglu as k
    from tests.kernels.test_fp8_moe_compile import compile_for_h200

    signature = {"G": "*bf16", "U": "*bf16", "Y": "*bf16", "width": "i32", "stride_g": "i32"}
    signature |= {"stride_u": "i32", "limit": "fp32"}
    constants = {"HAS_LIMIT": limit, "BLOCK": k.BLOCK}
    built = compile_for_h200(k._swiglu_kernel, signature, constants, {"num_warps": 4})
    assert built.asm["cubin"] and ".local" not in built.asm["ptx"]
