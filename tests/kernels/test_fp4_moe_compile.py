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
ROUTING = ("PAIRS_PAD", "BY_EXPERT", "ROWS", "COLUMNS", "K_BLOCK")


def compile_for_h200(kernel, signature: dict, constants: dict) -> object:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    signature = {**signature, **{name: "constexpr" for name in constants}}
    source = ASTSource(fn=kernel, signature=signature, constexprs=constants)
    return triton.compile(source, target=GPUTarget(*H200),
                          options={"num_warps": 4, "num_stages": 4})  # fmt: skip


@pytest.mark.parametrize("by_expert", [False, True])
def test_kernels_compile_for_sm90(by_expert: bool) -> None:
    from afdserve.kernels import triton_fp4_moe

    routing = dict(zip(ROUTING, (64 if not by_expert else 1024, by_expert, 16, 32, 128),
                       strict=True))  # fmt: skip
    gate_up = compile_for_h200(triton_fp4_moe._gate_up_kernel, GATE_UP,
                               {"HAS_LIMIT": True, **routing})  # fmt: skip
    down = compile_for_h200(triton_fp4_moe._down_kernel, DOWN, routing)
    for kernel in (gate_up, down):
        assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]  # nothing spilled
