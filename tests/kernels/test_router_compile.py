"""The router's select kernel (kernels/moe/router.py) compiles for the H200 (sm_90) down to a
cubin with each scoring (softmax, sigmoid, DeepSeek-V4's sqrt(softplus) with its selection bias,
and its hash layers' table lookup) at V4-Flash's 256 experts and top-6, on any machine with
Triton. Its numbers are tests/kernels/test_router_interpret.py's on CPU and
tests/gpu/test_router_kernel.py's on a GPU."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import compile_for_h200

triton = pytest.importorskip("triton")


@pytest.mark.parametrize(
    "scoring, hashed",
    [("softmax", False), ("sigmoid", False), ("sqrtsoftplus", False), ("sqrtsoftplus", True)],
)
def test_select_kernel_compiles_for_sm90(scoring, hashed) -> None:
    from afdserve.kernels.moe import router as k

    signature = {"partial_ptr": "*fp32", "bias_ptr": "*fp32", "table_ptr": "*i64"}
    signature |= {"tokens_ptr": "*i64", "ids_ptr": "*i64"}
    signature |= {"weights_ptr": "*fp32", "rows": "i32", "experts": "i32", "splits": "i32"}
    signature |= {"table_rows": "i32", "scale": "fp32"}
    constants = {
        "HAS_BIAS": scoring != "softmax" and not hashed,
        "HASH": hashed,
        "SCORING": k.SCORINGS.index(scoring),
        "NORMALIZE": True,
        "TOP_K": 6,
        "E_PAD": 256,
        "K_PAD": 8,
    }
    built = compile_for_h200(k._select_kernel, signature, constants, {"num_warps": 1})
    assert built.asm["cubin"]
