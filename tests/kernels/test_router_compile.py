"""The router's select kernel (kernels/moe/router.py) compiles for the H200 (sm_90) down to a
cubin with each scoring (softmax, sigmoid, DeepSeek-V4's sqrt(softplus) with its selection bias,
and its hash layers' table lookup) at V4-Flash's 256 experts and top-6, on any machine with
Triton. Its numbers are tests/kernels/test_router_interpret.py's on CPU and
tests/gpu/test_router_kernel.py's on a GPU."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import compile_for_h200

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("scoring", ["softmax", "sigmoid", "sqrtsoftplus"])
def test_select_kernel_compiles_for_sm90(scoring) -> None:
    from afdserve.kernels.moe import router as k

    signature = {"partial_ptr": "*fp32", "bias_ptr": "*fp32", "ids_ptr": "*i64"}
    signature |= {"weights_ptr": "*fp32", "rows": "i32", "experts": "i32", "splits": "i32"}
    signature |= {"scale": "fp32"}
    constants = {
        "HAS_BIAS": scoring != "softmax",
        "SCORING": k.SCORINGS.index(scoring),
        "NORMALIZE": True,
        "TOP_K": 6,
        "E_PAD": 256,
        "K_PAD": 8,
    }
    built = compile_for_h200(k._select_kernel, signature, constants, {"num_warps": 1})
    assert built.asm["cubin"]


def test_hash_select_kernel_compiles_for_sm90_with_its_token_assert() -> None:
    """The hash layers' select kernel is jitted with device asserts on (its own, not the
    process's): compiled so, its PTX calls the assert that stops a graph on a bad token id."""
    from afdserve.kernels.moe import router as k

    assert k._hash_select_kernel.debug and not k._select_kernel.debug
    signature = {"partial_ptr": "*fp32", "table_ptr": "*i64", "tokens_ptr": "*i64"}
    signature |= {"ids_ptr": "*i64", "weights_ptr": "*fp32", "rows": "i32", "experts": "i32"}
    signature |= {"splits": "i32", "table_rows": "i32", "scale": "fp32"}
    constants = {"SCORING": k.SCORINGS.index("sqrtsoftplus"), "TOP_K": 6, "E_PAD": 256, "K_PAD": 8}
    options = {"num_warps": 1, "debug": True}
    built = compile_for_h200(k._hash_select_kernel, signature, constants, options)
    assert "__assertfail" in built.asm["ptx"]
