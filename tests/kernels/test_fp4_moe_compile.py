"""The FP4 expert kernels (kernels/triton_fp4_moe.py) compile for the H200 (sm_90) down to a
cubin, on any machine with Triton: no GPU needed, so a CPU run catches a kernel that would not
build before the GPU run does. Their numbers are tests/gpu/test_fp4_moe.py's."""

from __future__ import annotations

import pytest

triton = pytest.importorskip("triton")

H200 = ("cuda", 90, 32)
GATE_UP = {
    "x_ptr": "*bf16",
    "ids_ptr": "*i64",
    "w_ptr": "*u8",
    "s_ptr": "*u8",
    "h_ptr": "*bf16",
    "num_pairs": "i32",
    "top_k": "i32",
    "hidden": "i32",
    "inter": "i32",
    "limit": "fp32",
}
DOWN = {
    "h_ptr": "*bf16",
    "ids_ptr": "*i64",
    "weights_ptr": "*fp32",
    "w_ptr": "*u8",
    "s_ptr": "*u8",
    "y_ptr": "*fp32",
    "num_pairs": "i32",
    "hidden": "i32",
    "inter": "i32",
}
ROUTING = ("PAIRS_PAD", "BY_EXPERT", "ROWS")


def compile_for_h200(kernel, signature: dict, constants: dict, options: dict) -> object:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget(*H200), options=options)


def test_kernels_compile_for_sm90() -> None:
    """With the launch's own constants: the one compile every batch uses."""
    from afdserve.kernels import triton_fp4_moe as k

    routing = dict(zip(ROUTING, (k.MAX_PAIRS, True, k.ROWS), strict=True))
    options = {"num_warps": k.WARPS, "num_stages": k.STAGES}
    gate_up = {"HAS_LIMIT": True, **routing, "COLUMNS": k.GATE_UP_COLUMNS, "K_BLOCK": 128}
    down = {**routing, "COLUMNS": k.DOWN_COLUMNS, "K_BLOCK": 128}
    gate_up = compile_for_h200(k._gate_up_kernel, GATE_UP, gate_up, options)
    down = compile_for_h200(k._down_kernel, DOWN, down, options)
    for kernel in (gate_up, down):
        assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]  # nothing spilled
