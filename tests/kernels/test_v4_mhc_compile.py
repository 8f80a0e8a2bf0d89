"""DeepSeek-V4's mHC mixing kernels (kernels/triton/mhc.py: the per-row form for decode batches, the
block-of-rows form for prefill, each way of its products) compile for the H200 (sm_90) down to a
cubin with no spills, at V4-Flash's site (4 streams of 4096, 24 mixings), bf16 streams, with and
without the update. Their numbers are tests/kernels/test_v4_mhc_interpret.py's on CPU and
tests/gpu/test_v4_fused.py's."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import compile_for_h200

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("by_rows", [False, "bf16x3", "ieee"])
@pytest.mark.parametrize("expand", [False, True])
def test_mix_kernels_compile_for_sm90(by_rows, expand) -> None:
    from afdserve.kernels.triton import mhc as k

    n, hidden = 4, 4096
    mix_pad = triton.next_power_of_2((2 + n) * n + 1)
    block = max(16, min(hidden, k.FN_TILE // (mix_pad * n)))
    kernel = k._mix_rows_kernel if by_rows else k._mix_kernel
    signature = dict.fromkeys(("H", "Y", "H_OUT"), "*bf16")
    signature |= dict.fromkeys(("POST", "COMB", "FN", "PARTIAL"), "*fp32")
    signature |= dict.fromkeys(("rows", "n", "hidden", "mixes"), "i32")
    constants = {
        "EXPAND": expand,
        "ROWS": k.BLOCK_ROWS if by_rows else k.MAX_ROWS_PER_PROGRAM,
        "CHUNKS": triton.cdiv(hidden, block),
        "BLOCK": block,
        "N_PAD": n,
        "MIX_PAD": mix_pad,
    }
    if by_rows:
        constants["DOT"] = by_rows  # the block-of-rows kernel's tensor-core products
    built = compile_for_h200(kernel, signature, constants, {"num_warps": 8})
    assert built.asm["cubin"] and ".local" not in built.asm["ptx"]
