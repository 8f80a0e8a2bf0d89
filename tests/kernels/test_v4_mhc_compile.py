"""DeepSeek-V4's mHC mixing kernels (kernels/triton/mhc.py: the per-row form for decode batches, the
block-of-rows form for prefill, each way of its products) compile for the H200 (sm_90) down to a
cubin with no spills, at V4-Flash's site (4 streams of 4096, 24 mixings), bf16 streams, with and
without the update. Their numbers are tests/kernels/test_v4_mhc_interpret.py's on CPU and
tests/gpu/test_v4_fused.py's."""

from __future__ import annotations

import re

import pytest

from tests.kernels.test_fp8_moe_compile import H200, compile_for_h200

triton = pytest.importorskip("triton")


def compile_as_launched(kernel, signature: dict, constants: dict, warps: int) -> object:
    """As a launch from torch builds it: the pointers and `hidden` (4096) known to be multiples
    of 16, so the streams' loads may be vector loads."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    aligned = {name for name, kind in signature.items() if kind.startswith("*")} | {"hidden"}
    attrs = {(kernel.arg_names.index(name),): [["tt.divisibility", 16]] for name in aligned}
    signature = {**signature, **dict.fromkeys(constants, "constexpr")}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H200), options={"num_warps": warps})


@pytest.mark.parametrize("by_rows", [False, "bf16x3", "ieee"])
@pytest.mark.parametrize("expand", [False, True])
def test_mix_kernels_compile_for_sm90(by_rows, expand) -> None:
    """No spills. The block-of-rows kernel (prefill): its streams, update and output read and
    written in 128-bit vectors, and few enough registers that two programs share an SM (its
    first form gathered 2-byte elements and took 239 registers, one program an SM)."""
    from afdserve.kernels.triton import mhc as k
    from tests.kernels.test_fp4_moe_compile import resources, sass

    n, hidden = 4, 4096
    mix_pad = triton.next_power_of_2((2 + n) * n + 1)
    if by_rows:
        rows_a_program, block, step, warps = k.rows_tiles(hidden)
    else:
        rows_a_program, warps = k.MAX_ROWS_PER_PROGRAM, 8
        block = max(16, min(hidden, k.FN_TILE // (mix_pad * n)))
    kernel = k._mix_rows_kernel if by_rows else k._mix_kernel
    signature = dict.fromkeys(("H", "Y", "H_OUT"), "*bf16")
    signature |= dict.fromkeys(("POST", "COMB", "FN", "PARTIAL"), "*fp32")
    signature |= dict.fromkeys(("rows", "n", "hidden", "mixes"), "i32")
    constants = {
        "EXPAND": expand,
        "ROWS": rows_a_program,
        "CHUNKS": triton.cdiv(hidden, block),
        "BLOCK": block,
        "N_PAD": n,
        "MIX_PAD": mix_pad,
    }
    if by_rows:
        constants["DOT"] = by_rows  # the block-of-rows kernel's tensor-core products
        constants["STEP"] = step
    built = compile_as_launched(kernel, signature, constants, warps)
    assert built.asm["cubin"] and ".local" not in built.asm["ptx"]
    used = resources(built)
    assert used.get("STACK", 0) == 0, used
    if by_rows:
        assert used["REG"] * warps * 32 * 2 <= 65536, used  # two programs an SM
        code = sass(built)
        assert not re.search(r"\b(LDG|STG)\.E\.U16\b", code), "2-byte loads or stores"
        assert re.search(r"\bSTG\.E\.128\b", code), "the streams not stored in vectors"


@pytest.mark.parametrize("rows", [1, 8, 63, 64, 8192])
def test_expand_kernel_compiles_for_sm90(rows) -> None:
    """The update alone at V4-Flash's streams, as `expand` launches it for decode batches and
    prefill: no spills, the streams read and written in 128-bit vectors."""
    from afdserve.kernels.triton import mhc as k
    from tests.kernels.test_fp4_moe_compile import resources, sass

    signature = dict.fromkeys(("H", "Y", "H_OUT"), "*bf16")
    signature |= dict.fromkeys(("POST", "COMB"), "*fp32")
    signature |= dict.fromkeys(("rows", "n", "hidden"), "i32")
    per_program, block, step, warps = k.expand_tiles(rows, 4096)
    constants = {"ROWS": per_program, "BLOCK": block, "STEP": step, "N_PAD": 4}
    built = compile_as_launched(k._expand_kernel, signature, constants, warps)
    assert resources(built).get("STACK", 0) == 0
    code = sass(built)
    assert not re.search(r"\b(LDG|STG)\.E\.U16\b", code), "2-byte loads or stores"
    assert re.search(r"\bSTG\.E\.128\b", code), "the streams not stored in vectors"


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
