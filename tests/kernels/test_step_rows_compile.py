"""What a ubatch builds once for its layers compiles for the H200 (sm_90) down to a cubin, on any
machine with Triton: the rows and window-rows kernels (kernels/triton/step_rows.py), the rows
kernel with and without state slots and window tables, and the rotary tables (rotary.cos_sin).
Their numbers are tests/kernels/test_step_rows_interpret.py's on CPU and the tiny V4's on a GPU
(tests/gpu/test_v4_fused_model.py, tests/gpu/test_step_rows.py)."""

from __future__ import annotations

import pytest

from tests.kernels.test_fp8_moe_compile import compile_for_h200

triton = pytest.importorskip("triton")


@pytest.mark.parametrize("slots, window", [(True, True), (False, False)])
def test_rows_kernel_compiles_for_sm90(slots, window) -> None:
    from afdserve.kernels.triton import step_rows as k

    signature = {"QUERY_START": "*i32", "CONTEXT": "*i32", "TABLES": "*i32", "SLOTS": "*i32"}
    signature |= {"WINDOW": "*i32", "TABLES_OUT": "*i64", "REAL_OUT": "*i1"}
    signature |= {"START_OUT": "*i64", "END_OUT": "*i64", "SLOTS_OUT": "*i64"}
    signature |= {"WINDOW_OUT": "*i64", "rows": "i32", "segments": "i32", "width": "i32"}
    signature |= {"window_width": "i32", "tables_stride": "i32", "window_stride": "i32"}
    constants = {"HAS_SLOTS": slots, "HAS_WINDOW": window, "ROWS": k.ROW_BLOCK}
    constants |= {"SEGMENTS": k.SEGMENT_BLOCK, "COLUMNS": k.COLUMN_BLOCK}
    built = compile_for_h200(k._rows_kernel, signature, constants, {"num_warps": 4})
    assert built.asm["cubin"]


def test_window_rows_kernel_compiles_for_sm90() -> None:
    from afdserve.kernels.triton import step_rows as k

    signature = {"POSITIONS": "*i64", "TABLES": "*i64", "OUT": "*i64", "window": "i32"}
    signature |= {"span": "i32", "block": "i32", "page_rows": "i32", "tables_stride": "i32"}
    built = compile_for_h200(k._window_rows_kernel, signature, {"WINDOW": 128}, {"num_warps": 1})
    assert built.asm["cubin"]


def test_cos_sin_kernel_compiles_for_sm90_with_libdevice_cos_and_sin() -> None:
    """The rows' rotary tables: torch's CUDA cos/sin are the accurate, range-reduced forms, so
    the kernel must not take the hardware's approximations (positions reach 2**20 and more)."""
    from afdserve.kernels.triton import rotary as k

    signature = {"POSITIONS": "*i64", "INV_FREQ": "*fp32", "COS": "*fp32", "SIN": "*fp32"}
    signature |= {"rows": "i32", "scaling": "fp32"}
    constants = {"HALF": 32, "ROWS": 16, "HALF_PAD": 32}
    built = compile_for_h200(k._cos_sin_kernel, signature, constants, {"num_warps": 4})
    ptx = built.asm["ptx"]
    assert "__nv_cosf" in ptx and "__nv_sinf" in ptx and ".approx" not in ptx
