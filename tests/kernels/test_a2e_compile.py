"""The fp8 A2E kernels (kernels/triton/a2e.py) compile for the H200 (sm_90) down to a cubin on any
machine with Triton, and their PTX holds only correctly rounded float32 arithmetic, which is what
makes them bit for bit a2e.py's torch functions: the division `div.rn.f32` (not Triton's
approximate `/`), no flush of subnormals (`.ftz`) and no fused multiply-add (one rounding where
torch rounds twice). Their numbers are tests/kernels/test_a2e_kernel_interpret.py's on CPU and
tests/gpu/test_a2e_kernels.py's on the GPU."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")

H200 = ("cuda", 90, 32)
LANGUAGE = {"bf16": "bfloat16", "fp16": "float16", "fp32": "float32"}  # triton.language's names


def compile_for_h200(kernel, signature: dict, constants: dict) -> object:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget(*H200), options={"num_warps": 4})


def builds(dtype: str, ids: str) -> list[object]:
    """The three kernels for rows in `dtype` (also the output's), route ids of type `ids`."""
    import triton.language as tl

    from afdserve.kernels.triton import a2e as k

    rows, out = f"*{dtype}", getattr(tl, LANGUAGE[dtype])
    common = {"BLOCK_G": 8, "GROUP": 128}
    quantize = {"INV_MAX": k.INV_MAX, "FP8_MAX": k.FP8_MAX, **common}
    return [
        compile_for_h200(
            k._quantize_kernel,
            {
                "X": rows,
                "Q": "*fp8e4nv",
                "S": "*fp32",
                "hidden": "i32",
                "n_groups": "i32",
                "stride_x": "i32",
            },
            quantize,
        ),
        compile_for_h200(
            k._dequantize_kernel,
            {
                "Q": "*fp8e4nv",
                "S": "*fp32",
                "Y": rows,
                "hidden": "i32",
                "n_groups": "i32",
                "stride_q": "i32",
                "stride_s": "i32",
            },
            {"OUT": out, **common},
        ),
        compile_for_h200(
            k._roundtrip_kernel,
            {"X": rows, "IDS": ids, "Y": rows, "hidden": "i32", "stride_x": "i32"},
            {"HAS_IDS": True, "OUT": out, **quantize},
        ),
    ]


@pytest.mark.parametrize(("dtype", "ids"), [("bf16", "*i64"), ("fp16", "*i32"), ("fp32", "*i64")])
def test_kernels_compile_for_sm90_with_exact_arithmetic(dtype: str, ids: str) -> None:
    kernels = builds(dtype, ids)
    for kernel in kernels:
        ptx = kernel.asm["ptx"]
        assert kernel.asm["cubin"] and ".local" not in ptx
        float_ops = set(re.findall(r"\b(?:add|sub|mul|div|fma|rcp|cvt)\.[\w.]*f32[\w.]*", ptx))
        inexact = {op for op in float_ops if any(w in op for w in ("fma", "ftz", "approx", "full"))}
        assert not inexact, float_ops
    quantize, _, roundtrip = (kernel.asm["ptx"] for kernel in kernels)
    assert "div.rn.f32" in quantize and "div.rn.f32" in roundtrip
    assert "cvt.rn.satfinite.e4m3x2.f32" in quantize
