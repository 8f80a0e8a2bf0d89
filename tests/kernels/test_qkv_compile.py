"""The GQA prologue (kernels/triton/qkv.py) compiles for the H200 (sm_90) on any machine with
Triton, no GPU needed, at the tiles `prepare_qkv` launches: one row a program (decode) and
prefill's `PREFILL_ROWS`, over a bf16 and an FP8 cache, Qwen3's per-head norms and MiniMax-M2's
norm over the heads (one row a program), with no spills to local memory. Its numbers are
tests/gpu/test_qkv_kernel.py's and, on CPU, tests/kernels/test_qkv_interpret.py's."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

H200 = ("cuda", 90, 32)


def compile_for_h200(rows: int, fp8: bool, over_heads: bool = False) -> object:
    """The launch `prepare_qkv` makes for `rows` rows: Qwen3-30B-A3B's heads (32 q, 4 KV, dim
    128, full rotary), or MiniMax-M2's norm over its 48 q and 8 KV heads with rotary on 64 of
    128 channels."""
    import triton.language as tl
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from afdserve.kernels.triton import qkv

    kernel = qkv._qkv_kernel
    heads, kv_heads, rot_half = (48, 8, 32) if over_heads else (32, 4, 64)
    tile, warps = qkv.launch_tile(rows, rot_half, over_heads)
    constants = {
        "HEADS": heads,
        "KV_HEADS": kv_heads,
        "DIM": 128,
        "DIM_PAD": 128,
        "ROT_HALF": rot_half,
        "ROT_PAD": rot_half,
        "PASS_PAD": 128 - 2 * rot_half if over_heads else 1,
        "Q_NORM_PAD": triton.next_power_of_2(heads * 128) if over_heads else 1,
        "K_NORM_PAD": triton.next_power_of_2(kv_heads * 128) if over_heads else 1,
        "INTERLEAVE": False,
        "NORM": True,
        "OVER_HEADS": over_heads,
        "DT": tl.bfloat16,
        "FP8_KV": fp8,
        "ROWS": tile,
    }
    cache = "*fp8e4nv" if fp8 else "*bf16"
    pointers = {"X": "*bf16", "QW": "*bf16", "KW": "*bf16", "COS": "*fp32", "SIN": "*fp32"}
    pointers.update(SLOT="*i64", Q="*bf16", K_CACHE=cache, V_CACHE=cache)
    signature = {name: "i32" for name in kernel.arg_names}
    signature.update(pointers, eps="fp32", k_scale="fp32", v_scale="fp32")
    signature.update({name: "constexpr" for name in constants})
    aligned = [n for n in kernel.arg_names if signature[n].startswith("*")]
    attrs = {(kernel.arg_names.index(n),): [["tt.divisibility", 16]] for n in aligned}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H200), options={"num_warps": warps})


@pytest.mark.parametrize("fp8", [False, True])
@pytest.mark.parametrize("tile", ["decode", "prefill"])
def test_qkv_tiles_compile_without_spills(tile: str, fp8: bool) -> None:
    from afdserve.kernels.triton import qkv

    compiled = compile_for_h200(qkv.PREFILL_FROM if tile == "prefill" else 1, fp8)
    assert compiled.asm["cubin"] and ".local" not in compiled.asm["ptx"]
    assert (compiled.metadata.num_warps, tile) in ((1, "decode"), (4, "prefill"))


def test_norm_over_heads_compiles_without_spills() -> None:
    compiled = compile_for_h200(4096, False, over_heads=True)  # one row a program at any count
    assert compiled.asm["cubin"] and ".local" not in compiled.asm["ptx"]
