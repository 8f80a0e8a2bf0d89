"""DeepSeek-V4's mHC mixing kernels (kernels/triton/mhc.py: the per-row form for decode batches, the
block-of-rows form for prefill, each way of its products) compile for the H200 (sm_90) down to a
cubin with no spills, at V4-Flash's site (4 streams of 4096, 24 mixings), bf16 streams, with and
without the update. Their numbers are tests/kernels/test_v4_mhc_interpret.py's on CPU and
tests/gpu/test_v4_fused.py's."""

from __future__ import annotations

import re

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


def test_collapse_kernel_compiles_for_sm90_and_loads_the_partials_at_once() -> None:
    """The collapse at V4-Flash's site (64 chunks of partial sums, 4 streams, 20 Sinkhorn
    rounds): no spills, and the chunks' partials are not read in a loop over the chunks (one
    program a row: such a loop waits on each chunk's loads in turn, 64 times). The loops that
    load are the two passes over the hidden columns alone."""
    from afdserve.kernels.triton import mhc as k
    from tests.kernels.test_fp4_moe_compile import sass

    n, hidden = 4, 4096
    mix_pad = triton.next_power_of_2((2 + n) * n + 1)
    chunks = triton.cdiv(hidden, max(16, min(hidden, k.FN_TILE // (mix_pad * n))))
    assert chunks == 64
    signature = dict.fromkeys(("H", "WEIGHT", "X"), "*bf16")
    signature |= dict.fromkeys(("PARTIAL", "BASE", "SCALE", "POST_OUT", "COMB_OUT"), "*fp32")
    signature |= dict.fromkeys(("n", "hidden", "mixes"), "i32")
    signature |= dict.fromkeys(("hc_eps", "hc_norm_eps", "norm_eps"), "fp32")
    constants = {
        "ITERS": 20,
        "PARTS": chunks,
        "PARTS_PAD": chunks,
        "CHUNKS": triton.cdiv(hidden, k.COLLAPSE_BLOCK),
        "BLOCK": k.COLLAPSE_BLOCK,
        "N_PAD": n,
        "MIX_PAD": mix_pad,
    }
    built = compile_for_h200(k._collapse_kernel, signature, constants, {"num_warps": 4})
    assert built.asm["cubin"] and ".local" not in built.asm["ptx"]
    loading = [loads for loads in loads_by_loop(sass(built)) if loads]
    # The two passes over the hidden columns (the collapse, the norm); a loop over the chunks'
    # partials, 4 loads an iteration, was a third (2026-12-07: [4, 32, 16]).
    assert len(loading) == 2, loading


def loads_by_loop(code: str) -> list[int]:
    """The global loads (LDG) inside each loop of a SASS listing, a loop being the instructions
    from a backward branch's target to the branch, in order."""
    instructions = [
        (int(m.group(1), 16), m.group(2))
        for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", code)
    ]
    loops = []
    for at, text in instructions:
        back = re.search(r"\bBRA\s+0x([0-9a-f]+)", text)
        if back and int(back.group(1), 16) <= at:
            start = int(back.group(1), 16)
            loops.append(sum("LDG" in t for a, t in instructions if start <= a <= at))
    return loops
