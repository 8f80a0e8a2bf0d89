"""tools/fp4_ws_bench.py's warp-specialized FP4 kernel compiles for sm_90 on any machine with
Triton's Gluon, at the configs the tool times by default: no GPU needed, so the experiment stays
runnable as Triton moves. Its numbers are the tool's (on a GPU, against the reference)."""

from __future__ import annotations

import re

import pytest

triton = pytest.importorskip("triton")
pytest.importorskip("triton.experimental.gluon")

from tests.kernels.test_fp4_moe_compile import sass  # noqa: E402
from tools import fp4_ws_bench as bench  # noqa: E402

H200 = ("cuda", 90, 32)


def compile_config(config: bench.Config, hidden: int = 4096, width: int = 4096, n: int = 8):
    import torch
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    w_desc, x_desc, s_desc = bench.descriptors(
        torch.zeros(8 * width, hidden // 8, dtype=torch.int32),
        torch.zeros(8 * n, hidden, dtype=torch.bfloat16),
        torch.zeros(8 * hidden // 32, width, dtype=torch.uint8),
        config[0],
        128,
        n,
    )
    kernel = bench.fp4_ws_kernel
    constants = bench.launch_options(config, hidden)
    options = {"num_warps": constants["num_warps"], "maxnreg": constants.pop("maxnreg")}
    signature = {
        "w_desc": mangle_type(w_desc),
        "x_desc": mangle_type(x_desc),
        "s_desc": mangle_type(s_desc),
        "slot_expert_ptr": "*i32",
        "out_ptr": "*fp32",
        "rows_per_expert": "i32",
        "out_row": "i32",
        **{name: "constexpr" for name in constants},
    }
    aligned = ("slot_expert_ptr", "out_ptr", "rows_per_expert", "out_row")
    attrs = {(kernel.arg_names.index(a),): [["tt.divisibility", 16]] for a in aligned}
    source = GluonASTSource(fn=kernel, signature=signature, constexprs=constants, attrs=attrs)
    return triton.compile(source, target=GPUTarget(*H200), options=options)


@pytest.mark.parametrize("config", bench.parse_configs(bench.DEFAULT_CONFIGS))
def test_warp_specialized_fp4_kernel_compiles_for_sm90(config: tuple[int, ...]) -> None:
    """The cubin has its partitions (register reallocation), the weights and x by TMA, the dots
    as async wgmma from shared memory, and fits one SM's shared memory."""
    kernel = compile_config(config)
    code = sass(kernel)
    assert "USETMAXREG" in code and "UTMALDG" in code, config
    assert re.search(r"HGMMA\.64x8x16\.F32\.BF16 R\d+, gdesc", code), config
    assert kernel.metadata.shared <= 227 * 1024, kernel.metadata.shared
