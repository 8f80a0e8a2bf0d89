"""FP4 routed experts for prefill-sized batches: the experts dequantized to x's dtype a group at a
time, then the grouped GEMM (grouped.py) over the pairs routed into the group.

The decode kernels (fp4_decode.py) decode each weight in registers for the pairs of one launch,
at most `fp4_decode.MAX_PAIRS`; a longer batch runs in row chunks that each decode every touched
expert again. At DeepSeek-V4-Flash's experts (256 x 3 x 4096 x 2048, top-6) a chunk of 85 rows
touches ~220 experts and costs ~2.6 ms (the batch-64 step's 2.26 ms, docs/benchmarks.md), so an
8192-token prefill spends ~97 chunks, ~250 ms, a layer in its experts. Here each weight is decoded
once a call (a bf16 copy of `GROUP_BYTES` at most at a time) and the GEMMs run in tiles of many
rows per expert. gpt-oss's MXFP4 experts (the same format) take it too, with their biases and gain
(grouped.py takes them). No host sync: graph capturable.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from afdserve.kernels.moe import grouped
from afdserve.kernels.reference.layers import ExpertGLU

# The bf16 (fp16) copy of one group of experts at most, in bytes: scratch memory against the
# number of grouped launches (one set per group).
GROUP_BYTES = 1 << 30
# h and y of the grouped GEMM (grouped.moe_experts' scratch) at most, in bytes: more pairs run
# in row slices, each reading the group's copy again.
SLICE_BYTES = 1 << 30
# Pairs from which `ops.moe_experts_fp4` takes this path: three decode-kernel chunks. Untimed: a
# crossover for the H200's sweep (tools/fp4_moe_bench.py).
MIN_PAIRS = 1536
BLOCK = 1024  # packed bytes per dequantizing program


def supports(x: torch.Tensor, gate_up: tuple, down: tuple) -> bool:
    """What grouped.py runs (CUDA bf16/fp16 rows; the dims multiples of 16) over uint8 FP4
    pairs whose rows hold whole scale groups (inputs a multiple of 32)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)):
        return False
    tensors = (*gate_up, *down)
    if not all(t.dtype == torch.uint8 and t.is_contiguous() for t in tensors):
        return False
    hidden, inter = 2 * gate_up[0].shape[2], 2 * down[0].shape[2]
    return hidden % 32 == 0 and inter % 32 == 0 and x.shape[-1] == hidden


@triton.jit
def _e2m1(code):
    """e2m1 codes (int32, 0..15) -> float32: sign (bit 3), exponent (bits 2-1, bias 1) and
    mantissa (bit 0); exponent 0 is the subnormal 0.5 m. Powers of two built from their bits."""
    exponent = (code >> 1) & 3
    mantissa = (code & 1).to(tl.float32)
    power = ((exponent + 126) << 23).to(tl.float32, bitcast=True)  # 2^(exponent - 1)
    magnitude = tl.where(exponent == 0, 0.5 * mantissa, power * (1.0 + 0.5 * mantissa))
    return tl.where((code & 8) != 0, -magnitude, magnitude)


@triton.jit
def _dequantize_kernel(packed_ptr, scale_ptr, out_ptr, num_bytes, BLOCK: tl.constexpr):
    """Bytes [i, i + BLOCK) of the flat packed stack: byte b holds inputs 2b (low nibble) and
    2b + 1; its scale is byte b // 16 of the flat scales (a row holds whole groups of 32)."""
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < num_bytes
    b = tl.load(packed_ptr + offs, mask=ok, other=0).to(tl.int32)
    s = tl.load(scale_ptr + offs // 16, mask=ok, other=127).to(tl.int32)
    # 2^(s - 127) from its bits; s = 0 is 2^-127, a float32 subnormal (bit 22 alone).
    factor = tl.where(s == 0, (1 << 22), s << 23).to(tl.float32, bitcast=True)
    out = out_ptr + 2 * offs
    tl.store(out, (_e2m1(b & 15) * factor).to(out_ptr.dtype.element_ty), mask=ok)
    tl.store(out + 1, (_e2m1(b >> 4) * factor).to(out_ptr.dtype.element_ty), mask=ok)


def dequantize(packed: torch.Tensor, scale: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """`fp4.dequantize_fp4(packed, scale, out.dtype)` into `out` (contiguous, packed's shape with
    the last dim doubled), bit for bit: the float32 product is exact, rounded once."""
    n = packed.numel()
    if n:
        _dequantize_kernel[(triton.cdiv(n, BLOCK),)](packed, scale, out, n, BLOCK=BLOCK)
    return out


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None = None,
    glu: ExpertGLU | None = None,
    group_bytes: int = GROUP_BYTES,
) -> torch.Tensor:
    """Same contract as `fp4.moe_experts_fp4` (ids -1: no expert; `glu`: gpt-oss's biases,
    contiguous, and gain). Check `supports` first. `group_bytes`: the dequantized copy's bound
    (tests pass small ones)."""
    glu = glu or ExpertGLU()
    experts, two_inter, half_hidden = gate_up[0].shape
    hidden, inter = 2 * half_hidden, two_inter // 2
    if experts == 0 or topk_ids.numel() == 0:
        return torch.zeros_like(x)
    per_expert = 3 * hidden * inter * x.element_size()
    size = max(1, min(experts, group_bytes // per_expert))
    w13 = torch.empty(size, two_inter, hidden, dtype=x.dtype, device=x.device)
    w2 = torch.empty(size, hidden, inter, dtype=x.dtype, device=x.device)
    max_pairs = max(grouped.GROUPED_MAX_PAIRS, SLICE_BYTES // (2 * inter + 4 * hidden))
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for first in range(0, experts, size):
        last = min(experts, first + size)
        n = last - first
        dequantize(gate_up[0][first:last], gate_up[1][first:last], w13[:n])
        dequantize(down[0][first:last], down[1][first:last], w2[:n])
        inside = (topk_ids >= first) & (topk_ids < last)
        ids = torch.where(inside, topk_ids - first, -1)
        b13, b2 = (None if b is None else b[first:last] for b in (glu.gate_up_bias, glu.down_bias))
        part = ExpertGLU(b13, b2, glu.alpha)
        out += grouped.moe_experts(
            x, ids, topk_weights, w13[:n], w2[:n], limit=limit, max_pairs=max_pairs, glu=part
        )
    return out.to(x.dtype)
