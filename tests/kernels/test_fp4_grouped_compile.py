"""The FP4 prefill path's kernels (kernels/moe/fp4_grouped.py: the in-register way's gate/up and
down at tiles of 16, 32 and 64 pairs; the dequantizing kernel, then grouped.py's kernels with
DeepSeek-V4's swiglu_limit, or gpt-oss's clamp, biases and gain, over the bf16 copy) compile for
the H200 (sm_90) down to a cubin, on any machine with Triton, at V4-Flash's shape: nothing
spilled to local memory, and the in-register dots are wgmma. Their numbers are
tests/kernels/test_fp4_grouped_interpret.py's on CPU."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import GROUPED_DOWN, GROUPED_GATE_UP, compile_for_h200

# The in-register way's arguments (fp4_grouped._direct_*_kernel), at Flash's shape.
DIRECT_GATE_UP = {
    **{n: t for n, t in GROUPED_GATE_UP.items() if n not in ("s_expert", "s_row", "inter_blocks")},
    "w_ptr": "*i32",
    "s_ptr": "*u8",
    "w_row": "i32",
    "s_row": "i32",
}
DIRECT_DOWN = {
    **{n: t for n, t in GROUPED_DOWN.items() if n not in ("s_expert", "s_row")},
    "w_ptr": "*i32",
    "s_ptr": "*u8",
    "w_row": "i32",
    "s_row": "i32",
}

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


@pytest.mark.parametrize(
    ("rows", "hidden", "inter", "glu", "one_dot"),
    [
        (16, 4096, 2048, False, False),
        (32, 4096, 2048, False, False),
        (64, 4096, 2048, False, False),
        (64, 2880, 2880, True, False),
        (64, 4096, 2048, False, True),
        (64, 2880, 2880, True, True),
    ],
    ids=[
        "deepseek-v4-16",
        "deepseek-v4-32",
        "deepseek-v4-64",
        "gpt-oss-64",
        "deepseek-v4-64-one-dot",
        "gpt-oss-64-one-dot",
    ],
)
def test_direct_kernels_compile_for_sm90(rows, hidden, inter, glu, one_dot) -> None:
    """gate/up with the clamps (V4's swiglu_limit; gpt-oss's with its biases and gain) and down,
    at `DIRECT_LAUNCH` over tiles of `rows` pairs (and with one dot a K step)."""
    from afdserve.kernels.moe import fp4_decode
    from afdserve.kernels.moe import fp4_grouped as k

    columns, down_columns, k_block, warps, stages, _ = k.DIRECT_LAUNCH
    common = {"ROWS": rows, "E_PAD": 128 if glu else 256, "HAS_BIAS": glu, "ONE_DOT": one_dot}
    gate_up = {
        **common,
        "COLUMNS": columns,
        **fp4_decode.k_constants(hidden, k_block),
        "HAS_LIMIT": True,
        "HAS_ALPHA": glu,
    }
    down = {**common, "COLUMNS": down_columns, **fp4_decode.k_constants(inter, k_block)}
    options = {"num_warps": warps, "num_stages": stages}
    for kernel, signature, constants in (
        (k._direct_gate_up_kernel, DIRECT_GATE_UP, gate_up),
        (k._direct_down_kernel, DIRECT_DOWN, down),
    ):
        order = [n for n in kernel.arg_names if n in signature]
        built = compile_for_h200(kernel, {n: signature[n] for n in order}, constants, options)
        assert built.asm["cubin"] and ".local" not in built.asm["ptx"], (kernel.fn.__name__, rows)
        assert "wgmma" in built.asm["ptx"], (kernel.fn.__name__, rows)
