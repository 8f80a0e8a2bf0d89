"""The FP4 prefill path's kernels (kernels/moe/fp4_grouped.py: the dequantizing kernel, then
grouped.py's kernels with DeepSeek-V4's swiglu_limit, or gpt-oss's clamp, biases and gain, over
the bf16 copy) compile for the
H200 (sm_90) down to a cubin, on any machine with Triton, at V4-Flash's shape: nothing spilled to
local memory. Their numbers are tests/kernels/test_fp4_grouped_interpret.py's on CPU."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import GROUPED_DOWN, GROUPED_GATE_UP, compile_for_h200

triton = pytest.importorskip("triton")


def test_dequantize_kernel_compiles_for_sm90() -> None:
    from afdserve.kernels.moe import fp4_grouped as k

    signature = {"packed_ptr": "*u8", "scale_ptr": "*u8", "out_ptr": "*bf16", "num_bytes": "i64"}
    kernel = compile_for_h200(k._dequantize_kernel, signature, {"BLOCK": k.BLOCK}, {})
    assert kernel.asm["cubin"] and ".local" not in kernel.asm["ptx"]


@pytest.mark.parametrize(
    ("hidden", "glu"), [(4096, False), (2880, True)], ids=["deepseek-v4", "gpt-oss"]
)
def test_grouped_kernels_with_the_limit_and_biases_compile_for_sm90(hidden, glu) -> None:
    """gate/up with the clamps (V4's swiglu_limit), and with gpt-oss's biases and gain; down
    with gpt-oss's bias; bf16 weights."""
    from afdserve.kernels.moe import grouped as k

    weights = {"w_ptr": "*bf16", "s_ptr": "*fp32"}
    columns, down_columns, warps, stages = k.COLUMNS
    common = {
        "ROWS": 64,
        "E_PAD": 128,
        "W_FP8": False,
        "X_SCALED": False,
        "A_FP8": False,
        "WEIGHTS_LEFT": False,
        "GDC": 0,
        "HAS_BIAS": glu,
    }
    gate_up = {**common, "COLUMNS": columns, "K_BLOCK": k._k_block(hidden), "HAS_LIMIT": True}
    gate_up["HAS_ALPHA"] = glu
    down = {**common, "COLUMNS": down_columns, "K_BLOCK": k._k_block(2048)}
    options = {"num_warps": warps, "num_stages": stages}
    for kernel, signature, constants in (
        (k._gate_up_kernel, {**GROUPED_GATE_UP, **weights}, gate_up),
        (k._down_kernel, {**GROUPED_DOWN, **weights}, down),
    ):
        built = compile_for_h200(kernel, signature, constants, options)
        assert built.asm["cubin"] and ".local" not in built.asm["ptx"]
