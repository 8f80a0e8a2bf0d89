"""The w8a8 FP8 GEMM (kernels/triton/fp8_w8a8.py's `_gemm_kernel`, every FP8 projection on CUDA,
grouped or not) compiles for the H200 (sm_90) down to a cubin, on any machine with Triton, with
the rows quantized in the GEMM or before it, K split and summed by the last split or not. Its
numbers are tests/kernels/test_fp8_fusions_interpret.py's on CPU (the grouped launch bit for bit
each group's own) and tests/gpu/test_fp8_kernels.py's against the oracle on a GPU."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import compile_for_h200

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("quantize", [False, True])
@pytest.mark.parametrize("split", [False, True])
def test_w8a8_gemm_compiles_for_sm90(quantize, split) -> None:
    from afdserve.kernels.triton import fp8_w8a8 as k

    signature = {
        "a_ptr": "*bf16" if quantize else "*fp8e4nv",
        "as_ptr": "*fp32",
        "w_ptr": "*fp8e4nv",
        "ws_ptr": "*fp32",
        "b_ptr": "*bf16",
        "y_ptr": "*bf16",
        "part_ptr": "*fp32",
        "count_ptr": "*i32",
    }
    names = ("M", "N", "K", "groups", "ws_stride", "k_per_split", "a_stride", "as_stride")
    signature |= dict.fromkeys((*names, "n_group"), "i32")
    bm, bn, bk, _, warps, stages = k.tiles_for(16 if quantize else 64, 8192, 4096)
    constants = {"HAS_BIAS": False, "BM": bm, "BN": bn, "BK": bk, "SPLIT": split}
    constants |= {"QUANTIZE": quantize, "GROUP": k.GROUP, "REDUCE": split}
    options = {"num_warps": warps, "num_stages": stages}
    built = compile_for_h200(k._gemm_kernel, signature, constants, options)
    assert built.asm["cubin"]
