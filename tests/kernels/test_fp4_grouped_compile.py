"""The FP4 prefill path's kernels (kernels/moe/fp4_grouped.py: the dequantizing kernel, then
grouped.py's gate/up kernel with DeepSeek-V4's swiglu_limit over the bf16 copy) compile for the
H200 (sm_90) down to a cubin, on any machine with Triton, at V4-Flash's shape: nothing spilled to
local memory. Their numbers are tests/kernels/test_fp4_grouped_interpret.py's on CPU."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import GROUPED_GATE_UP, compile_for_h200

triton = pytest.importorskip("triton")


def test_dequantize_kernel_compiles_for_sm90() -> None:
    from afdserve.kernels.moe import fp4_grouped as k

    signature = {"packed_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": "*bf16", "num_bytes": "i64"}
    kernel = compile_for_h200(k._dequantize_kernel, signature, {"BLOCK": k.BLOCK}, {})
    assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]


def test_grouped_gate_up_with_the_limit_compiles_for_sm90() -> None:
    from afdserve.kernels.moe import grouped as k

    bf16 = {name: "*bf16" for name in ("w_ptr",)}
    signature = {**GROUPED_GATE_UP, **bf16, "s_ptr": "*fp32"}
    columns, _, warps, stages = k.COLUMNS
    constants = {
        "ROWS": 64,
        "COLUMNS": columns,
        "K_BLOCK": k._k_block(4096),
        "E_PAD": 64,
        "W_FP8": False,
        "X_SCALED": False,
        "A_FP8": False,
        "WEIGHTS_LEFT": False,
        "GDC": 0,
        "HAS_LIMIT": True,
    }
    options = {"num_warps": warps, "num_stages": stages}
    kernel = compile_for_h200(k._gate_up_kernel, signature, constants, options)
    assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]
