"""DSA's kernels (kernels/triton/dsa_indexer.py, dsa_attention.py) compile for the H200 (sm_90) on
any machine with Triton, no GPU needed, at the launches the real models take (DeepSeek-V3.2's 64
indexer heads of 128 and index_topk 2048, 128 attention heads over latent 512 + rope 64, cache
blocks of 64, bf16 and FP8 pages), without spilling registers, their gathered loads pipelined.
Their numbers are tests/gpu/test_dsa.py's (and, on CPU, tests/kernels/test_dsa_interpret.py's)."""

from __future__ import annotations

import os
import re

import pytest

triton = pytest.importorskip("triton")
if os.environ.get("TRITON_INTERPRET") == "1":  # the kernels are interpreted functions then
    pytest.skip("compiles for sm_90: run without TRITON_INTERPRET", allow_module_level=True)

H200 = ("cuda", 90, 32)


def compile_for_h200(kernel, pointers: dict[str, str], constants: dict, warps: int) -> object:
    """Every other argument an i32 but the floats named `scale`/`k_scale`; pointers aligned to
    16 as torch's allocations are."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {name: "i32" for name in kernel.arg_names}
    signature.update({n: "fp32" for n in ("scale", "k_scale") if n in kernel.arg_names})
    signature.update(pointers)
    signature.update({name: "constexpr" for name in constants})
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in pointers}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H200), options={"num_warps": warps})


def assert_no_spills(compiled) -> None:
    """No local-memory traffic anywhere in the kernel's SASS (spilled registers)."""
    assert compiled.asm["cubin"] and ".local" not in compiled.asm["ptx"]
    try:
        sass = compiled.asm["sass"]
    except Exception:  # no nvdisasm beside this Triton: the PTX check stands alone
        return
    assert not re.search(r"\b(LDL|STL)\b", sass), "spills"


def assert_pipelined(compiled) -> None:
    """The main loop's gathered loads are asynchronous copies (its bound, not a branch inside
    it, says where it ends), so the next tile is in flight while this one computes."""
    assert "async_copy" in compiled.asm["ttgir"], "the loads are not pipelined"


@pytest.mark.parametrize("keys", ["*bf16", "*fp8e4nv"])
def test_indexer_kernels_compile_for_h200(keys):
    from afdserve.kernels.triton import dsa_indexer as di

    rows = {"TABLES": "*i64", "POSITIONS": "*i64", "REAL": "*i1"}
    scores = compile_for_h200(
        di._scores_kernel,
        {"Q": "*bf16", "WEIGHTS": "*fp32", "KEYS": keys, "SCORES": "*fp32", **rows},
        {
            "DIM": 128,
            "BLOCK": 64,
            "BLOCK_H": 64,
            "BLOCK_D": 128,
            "BLOCK_T": di.BLOCK_KEYS,
            "SPLITS": di.SPLITS,
            "PRECISION": "tf32",
        },
        warps=8,
    )
    top = compile_for_h200(
        di._top_kernel,
        {"SCORES": "*fp32", "OUT": "*i64", **rows},
        {"TOPK": 2048, "BLOCK": 64, "BLOCK_S": di.BLOCK_SCORES, "BLOCK_O": 1024},
        warps=8,
    )
    assert_no_spills(scores)
    assert_pipelined(scores)
    assert_no_spills(top)


@pytest.mark.parametrize("cache", ["*bf16", "*fp8e4nv"])
def test_sparse_mla_kernel_compiles_for_h200(cache):
    from afdserve.kernels.triton import dsa_attention as da

    compiled = compile_for_h200(
        da._sparse_mla_kernel,
        {"Q": "*bf16", "CACHE": cache, "SELECTED": "*i64", "SCAN": "*i64", "OUT": "*bf16"},
        {
            "LATENT": 512,
            "ROPE": 64,
            "TOPK": 2048,
            "FP8": cache == "*fp8e4nv",
            "BLOCK_H": 16 if cache == "*fp8e4nv" else 32,  # `sparse_mla`'s choice
            "BLOCK_N": da.BLOCK_ROWS,
            "BLOCK_L": 512,
            "BLOCK_R": 64,
            "PRECISION": "tf32",
        },
        warps=8,
    )
    assert_no_spills(compiled)
    assert_pipelined(compiled)
