"""The FP4 prefill path (kernels/moe/fp4_grouped.py) under Triton's interpreter (TRITON_INTERPRET=1,
numpy), on CPU:

1. Its dequantizing kernel against `fp4.dequantize_fp4`, bit for bit: every byte (both nibbles'
   16 codes), the scale bytes from 0 (2^-127, a float32 subnormal) to 254 in float32, and those
   fp16 and bf16 hold (bf16 from 2: scale byte 1's 2^-127 products are bf16 subnormals, which
   the interpreter, as a GPU may, flushes to zero; no checkpoint has scales that small).
2. The grouped GEMM (kernels/moe/grouped.py) with DeepSeek-V4's swiglu_limit, whose clamps bite
   on these rows, against `reference.moe_experts` with the same limit.
3. The whole path over several expert groups (a small `group_bytes`), pairs of id -1 among them
   and the limit, against `fp4.moe_experts_fp4` (the experts dequantized one at a time).
4. gpt-oss's expert biases and gain (`ExpertGLU`), in the grouped GEMM and over FP4 groups.
5. The in-register way (`direct=True`): tiles of 16, 32 and 64 pairs of one expert, float32 rows
   (only the accumulation order differs from the reference: float32's tolerance) and fp16 rows,
   random bytes (every code) under a spread of scale bytes, pairs of id -1, the limit, gpt-oss's
   biases and gain, columns past the dims, and row slices (a small `SLICE_BYTES`), against
   `fp4.moe_experts_fp4`; and the stacks it refuses by name.
fp16 rows (the interpreter's bf16 dots are wrong); in a subprocess because the variable must be
set before any @triton.jit function is defined; Triton 3.7 or later (grouped.py's loops)."""

from __future__ import annotations

from tests.kernels.interpret import run_interpreted

CASES = """
import torch
from afdserve.kernels.reference import fp4
from afdserve.kernels.reference import layers as reference
from afdserve.kernels.moe import fp4_decode, fp4_grouped, grouped

# 1. Every byte under every scale byte, one scale per row of 32 inputs (16 bytes).
codes = torch.arange(256, dtype=torch.uint8).reshape(16, 16)  # 16 rows of 16 bytes
for dtype, scales in [(torch.float32, range(0, 255)), (torch.float16, range(100, 140)),
                      (torch.bfloat16, range(2, 255))]:
    s = torch.tensor(list(scales), dtype=torch.uint8)
    packed = codes.repeat(len(s), 1)                       # [16 S, 16]
    scale = s.repeat_interleave(16)[:, None].contiguous()  # [16 S, 1]
    out = torch.empty(packed.shape[0], 32, dtype=dtype)
    fp4_grouped.dequantize(packed, scale, out)
    want = fp4.dequantize_fp4(packed, scale, dtype)
    assert torch.equal(out.view(torch.int16 if dtype != torch.float32 else torch.int32),
                       want.view(torch.int16 if dtype != torch.float32 else torch.int32)), dtype
    print("dequantize", dtype, "equal")

def rel(a, b):
    return float((a.float() - b.float()).norm() / b.float().norm())

gen = torch.Generator().manual_seed(3)
rows, experts, hidden, inter, top_k, limit = 24, 6, 64, 32, 2, 1.5
x = (2 * torch.randn(rows, hidden, generator=gen)).half()
ids = torch.rand(rows, experts, generator=gen).topk(top_k, dim=-1).indices
ids[::5, 1] = -1
weights = torch.rand(rows, top_k, generator=gen)

# 2. The grouped GEMM with the clamps.
w13 = (torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5).half()
w2 = (torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5).half()
want = reference.moe_experts(x.float(), ids, weights, w13.float(), w2.float(), limit)
free = reference.moe_experts(x.float(), ids, weights, w13.float(), w2.float())
assert rel(free, want) > 0.05  # the limit changes these rows' outputs
got = grouped.moe_experts(x, ids, weights, w13, w2, limit=limit)
print("grouped limit", rel(got, want))
assert rel(got, want) < 2e-3

# 3. FP4 experts over groups of two experts (group_bytes of two fp16 copies).
gate_up = fp4.quantize_fp4(torch.randn(experts, 2 * inter, hidden, generator=gen) * hidden**-0.5)
down = fp4.quantize_fp4(torch.randn(experts, hidden, inter, generator=gen) * inter**-0.5)
want = fp4.moe_experts_fp4(x.float(), ids, weights, gate_up, down, limit)
per_expert = 3 * hidden * inter * 2
for group in (1, 2, 4, experts):
    got = fp4_grouped.moe_experts(x, ids, weights, gate_up, down, limit,
                                  group_bytes=group * per_expert)
    print("fp4 grouped", group, rel(got, want))
    assert got.dtype == x.dtype and rel(got, want) < 2e-3, group

# 4. gpt-oss's biases and gain (MXFP4 is this format), grouped bf16-style and FP4 over groups.
glu = reference.ExpertGLU(
    (0.5 * torch.randn(experts, 2 * inter, generator=gen)).half(),
    (0.5 * torch.randn(experts, hidden, generator=gen)).half(),
    1.702,
)
glu32 = reference.ExpertGLU(glu.gate_up_bias.float(), glu.down_bias.float(), glu.alpha)
want = reference.moe_experts(x.float(), ids, weights, w13.float(), w2.float(), limit, glu32)
got = grouped.moe_experts(x, ids, weights, w13, w2, limit=limit, glu=glu)
print("grouped glu", rel(got, want))
assert rel(got, want) < 2e-3
want = fp4.moe_experts_fp4(x.float(), ids, weights, gate_up, down, limit, glu32)
got = fp4_grouped.moe_experts(x, ids, weights, gate_up, down, limit, glu,
                              group_bytes=2 * per_expert)
print("fp4 grouped glu", rel(got, want))
assert rel(got, want) < 2e-3

# 5. The in-register way.
hidden, inter, experts = 128, 64, 6
def packed(rows_out, cols_in):
    return (torch.randint(0, 256, (experts, rows_out, cols_in // 2), dtype=torch.uint8,
                          generator=gen),
            torch.randint(112, 121, (experts, rows_out, cols_in // 32), dtype=torch.uint8,
                          generator=gen))
gate_up, down = packed(2 * inter, hidden), packed(hidden, inter)
glu = reference.ExpertGLU(torch.randn(experts, 2 * inter, generator=gen),
                          torch.randn(experts, hidden, generator=gen), 1.702)
for rows, dtype, launch, use_glu, limit, rtol in [
    (5, torch.float32, (32, 64, 64, 4, 2), False, 1.0, 1e-5),        # 16-row tiles, clamps bite
    (40, torch.float32, (64, 128, 128, 4, 3), True, 10.0, 1e-5),     # 32-row tiles, columns past
    (100, torch.float16, fp4_grouped.DIRECT_LAUNCH, False, None, 3e-3),  # 64-row tiles
    (100, torch.float32, (16, 32, 256, 4, 2), True, None, 1e-5),     # K step wider than inter
    (40, torch.float32, (64, 128, 128, 4, 3, 1), True, 10.0, 1e-5),  # one dot a K step
    (100, torch.float16, (64, 128, 128, 4, 3, 1), False, None, 3e-3),
]:
    x = torch.randn(rows, hidden, generator=gen).to(dtype)
    ids = torch.rand(rows, experts, generator=gen).topk(top_k, dim=-1).indices
    ids[::7, 0] = -1
    weights = torch.rand(rows, top_k, generator=gen)
    g = glu if use_glu else None
    want = fp4.moe_experts_fp4(x.float(), ids, weights, gate_up, down, limit, g)
    got = fp4_grouped.moe_experts(x, ids, weights, gate_up, down, limit,
                                  None if g is None else reference.ExpertGLU(
                                      g.gate_up_bias.to(dtype), g.down_bias.to(dtype), g.alpha),
                                  direct=True, launch=launch)
    print("direct", rows, dtype, launch, rel(got, want))
    assert got.dtype == dtype and rel(got, want) < rtol, (rows, dtype, launch)
# A K tail: hidden 192 is one step of 128 and one of 64 (fp4_decode.k_steps), gpt-oss's way.
hidden = 192
tail_gate_up, tail_down = packed(2 * inter, hidden), packed(hidden, inter)
assert fp4_decode.k_steps(hidden, 128) == (128, 64)
x = torch.randn(40, hidden, generator=gen)
ids = torch.rand(40, experts, generator=gen).topk(top_k, dim=-1).indices
weights = torch.rand(40, top_k, generator=gen)
tail_glu = reference.ExpertGLU(glu.gate_up_bias, torch.randn(experts, hidden, generator=gen), 1.702)
want = fp4.moe_experts_fp4(x, ids, weights, tail_gate_up, tail_down, 10.0, tail_glu)
got = fp4_grouped.moe_experts(x, ids, weights, tail_gate_up, tail_down, 10.0, tail_glu,
                              direct=True, launch=(32, 64, 128, 4, 2))
print("direct tail", rel(got, want))
assert rel(got, want) < 1e-5
hidden = 128
# Row slices: scratch for 30 pairs at a time.
fp4_grouped.SLICE_BYTES = 30 * (2 * inter + 4 * hidden)
x = torch.randn(50, hidden, generator=gen)
ids = torch.rand(50, experts, generator=gen).topk(top_k, dim=-1).indices
weights = torch.rand(50, top_k, generator=gen)
want = fp4.moe_experts_fp4(x, ids, weights, gate_up, down, 10.0)
got = fp4_grouped.moe_experts(x, ids, weights, gate_up, down, 10.0, direct=True)
print("direct slices", rel(got, want))
assert rel(got, want) < 1e-5
odd = (gate_up[0][:, :, :24].contiguous(), gate_up[1][:, :, :3].contiguous())  # hidden 48
try:
    fp4_grouped.moe_experts(x[:, :48], ids, weights, odd, down, direct=True)
except ValueError as e:
    assert "multiples of 64" in str(e), e
    print("direct refused")
else:
    raise AssertionError("hidden 48 was not refused")
"""


def test_fp4_prefill_path_under_the_interpreter() -> None:
    run = run_interpreted(CASES, timeout=600, min_triton=(3, 7))
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.count("equal") == 3 and run.stdout.count("fp4 grouped") == 5, run.stdout
    # Four cases, the row slices and the refusal.
    assert run.stdout.count("direct ") == 9 and "direct refused" in run.stdout, run.stdout
