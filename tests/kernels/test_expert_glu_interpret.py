"""The expert decode kernels with gpt-oss's SwiGLU (`ExpertGLU`): gate/up and down biases, the
clamp and the sigmoid gain alpha with up offset by one, on CPU under Triton's interpreter
against `reference.moe_experts` in float32: the FP4 kernels (kernels/moe/fp4_decode.py, MXFP4)
over the dequantized weights, and the unquantized ones (kernels/moe/decode.py, bf16 gpt-oss).

Cases: biases and gain with the clamp binding, biases alone, the gain alone; float32 rows
(float32's tolerance) and fp16; the FP4 kernels' K split; expert-parallel ids (-1: pairs held
elsewhere, and expert slots without pairs, whose bias loads read expert 0's and are never
stored). Skipped without Triton, or where its interpreter cannot run a loop on this numpy (3.6
on numpy 2.4; run it with numpy < 2.4)."""

from __future__ import annotations

import pytest

from tests.kernels.interpret import run_interpreted
from tests.kernels.test_attention_interpret import interpreter_runs

CASES = """
import torch
from afdserve.kernels.reference import fp4
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.moe import decode
from afdserve.kernels.moe import fp4_decode as k
from afdserve.kernels.triton import counters

def experts(e, rows_out, cols_in, gen):
    packed = torch.randint(0, 256, (e, rows_out, cols_in // 2), dtype=torch.uint8, generator=gen)
    scale = torch.randint(112, 124, (e, rows_out, cols_in // 32), dtype=torch.uint8, generator=gen)
    return packed, scale

def check(rows, dtype, biases, alpha, limit, absent, seed, rtol, splits=1):
    # A K split needs two steps of 64 to cut: dims of 128 then.
    hidden = inter = 64 if splits == 1 else 128
    top_k, e = 2, 4
    gen = torch.Generator().manual_seed(seed)
    gate_up, down = experts(e, 2 * inter, hidden, gen), experts(e, hidden, inter, gen)
    b13 = torch.randn(e, 2 * inter, generator=gen).to(dtype) if biases else None
    b2 = torch.randn(e, hidden, generator=gen).to(dtype) if biases else None
    glu = reference.ExpertGLU(b13, b2, alpha)
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    ids = torch.rand(rows, e, generator=gen).topk(top_k, dim=-1).indices
    if absent:  # an expert-parallel shard: pairs of experts 2 and 3 are held elsewhere
        ids = torch.where(ids >= 2, -1, ids)
    weights = torch.rand(rows, top_k, generator=gen)
    tiles = k.Tiles(32, 32, k_block=64, splits=splits)
    out = k.moe_experts(x, ids, weights, gate_up, down, limit, lambda pairs: tiles, glu=glu)
    w13 = fp4.dequantize_fp4(*gate_up, torch.float32)
    w2 = fp4.dequantize_fp4(*down, torch.float32)
    glu32 = reference.ExpertGLU(
        None if b13 is None else b13.float(), None if b2 is None else b2.float(), alpha
    )
    ref = reference.moe_experts(x.float(), ids, weights, w13, w2, limit, glu32)
    err = float((out.float() - ref).norm() / ref.norm())
    assert out.dtype == dtype and err < rtol, (rows, dtype, biases, alpha, limit, absent, err)
    return err

for rows, dtype, biases, alpha, limit, absent, rtol in [
    (3, torch.float32, True, 1.702, 1.0, False, 1e-6),  # the clamp binds
    (5, torch.float32, True, None, None, False, 1e-6),  # biases alone
    (5, torch.float32, False, 1.702, 7.0, False, 1e-6),  # the gain alone
    (7, torch.float32, True, 1.702, 1.0, True, 1e-6),  # pairs held elsewhere
    (3, torch.float16, True, 1.702, 1.0, False, 3e-3),  # h in fp16
]:
    print(rows, dtype, check(rows, dtype, biases, alpha, limit, absent, rows, rtol))
# Both K split in two (Tiles.splits): the biases and the gain in the last split's epilogue,
# with pairs held elsewhere.
print("split", check(7, torch.float32, True, 1.702, 1.0, True, 7, 1e-6, splits=2))
assert counters._COUNTERS, "the launch ran unsplit"

def check_plain(rows, dtype, absent, seed, rtol):
    hidden, inter, top_k, e = 64, 48, 2, 4
    gen = torch.Generator().manual_seed(seed)
    w13 = (torch.randn(e, 2 * inter, hidden, generator=gen) / 8).to(dtype)
    w2 = (torch.randn(e, hidden, inter, generator=gen) / 7).to(dtype)
    glu = reference.ExpertGLU(
        torch.randn(e, 2 * inter, generator=gen).to(dtype),
        torch.randn(e, hidden, generator=gen).to(dtype),
        1.702,
    )
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    ids = torch.rand(rows, e, generator=gen).topk(top_k, dim=-1).indices
    if absent:
        ids = torch.where(ids >= 2, -1, ids)
    weights = torch.rand(rows, top_k, generator=gen)
    out = decode.moe_experts(x, ids, weights, w13, w2, 1.0, glu)
    glu32 = reference.ExpertGLU(glu.gate_up_bias.float(), glu.down_bias.float(), 1.702)
    ref = reference.moe_experts(x.float(), ids, weights, w13.float(), w2.float(), 1.0, glu32)
    err = float((out.float() - ref).norm() / ref.norm())
    assert out.dtype == dtype and err < rtol, (rows, dtype, absent, err)
    return err

for rows, dtype, absent, rtol in [
    (3, torch.float32, False, 1e-5),
    (9, torch.float32, True, 1e-5),
    (5, torch.float16, False, 3e-3),
]:
    print("decode", rows, dtype, check_plain(rows, dtype, absent, rows, rtol))
print("ok")
"""


def test_expert_glu_kernels_under_the_interpreter() -> None:
    pytest.importorskip("triton")
    if not interpreter_runs():
        pytest.skip("this Triton's interpreter cannot run a loop on this numpy")
    run = run_interpreted(CASES, timeout=600, env={"TRITON_DEFAULT_FP_FUSION": "1"})
    assert run.returncode == 0 and run.stdout.strip().endswith("ok"), run.stdout + run.stderr
