"""Routed experts as two grouped GEMMs (`torch.nn.functional.grouped_mm`), with no host sync:
the path of prefill chunks (compute-bound), where cuBLAS's grouped GEMM beats tiles of our own.

Pairs are sorted by expert on the device; per-expert pair counts become the grouped GEMM's
offsets, so the number of rows each expert gets never reaches the host (the reference's
`.tolist()` does). Pairs of no expert here (id outside [0, experts): pad rows, experts another
rank holds) sort past the last group, where neither GEMM computes them. Around the GEMMs, two
Triton launches rather than torch's elementwise chain: the activation over the gate/up output in
place (kernels/triton/swiglu.py), and the routing weights and the sum of each row's pairs in one
read of the down output (`decode.sum_pairs` through each pair's slot), in float32, rounded once.
That chain (a float32 copy of y, its product with the weights, a cast back and an atomic
index_add_) took twice the GEMMs' time in an 8192-token prefill step (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from afdserve.kernels.moe.decode import sum_pairs
from afdserve.kernels.triton.swiglu import swiglu

# The weighted sum's tile (hidden columns a program takes, warps): 1024 x 4 took 110 us for
# 65536 pairs of 2048 channels on an H100 where decode's 512 x 4 took 202, 2048 x 8 109 (tools/
# prefill_experts_bench.py --sweep, docs/benchmarks.md, 2026-12-07).
SUM_TILE = (1024, 4)


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """grouped_mm runs bf16 only; its operands need 16-byte aligned rows."""
    if not hasattr(F, "grouped_mm") or not x.is_cuda:
        return False
    if not (x.dtype == gate_up.dtype == down.dtype == torch.bfloat16):
        return False
    hidden, inter = gate_up.shape[2], down.shape[2]
    return hidden % 8 == 0 and inter % 8 == 0


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    """Same contract as `reference.moe_experts` (ids -1 go to no expert). x [rows, hidden] bf16
    on CUDA (`supports`)."""
    rows, top_k = topk_ids.shape
    experts, inter = gate_up.shape[0], down.shape[2]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)  # row-major, as the sum writes
    if rows == 0:
        return out
    flat_ids = topk_ids.reshape(-1)
    order, offsets, slots = group_pairs(flat_ids, experts)
    sorted_x = x.index_select(0, order // top_k)  # [rows * k, hidden]
    # grouped_mm computes a @ b per group with b [E, K, N]: the stored [E, N, K] weights
    # transposed. Rows past the last group are left unwritten, and nothing reads them.
    gate_up_out = F.grouped_mm(sorted_x, gate_up.transpose(1, 2), offs=offsets)
    h = swiglu(gate_up_out[:, :inter], gate_up_out[:, inter:], rows_end=offsets[-1:])
    y = F.grouped_mm(h, down.transpose(1, 2), offs=offsets)  # [rows * k, hidden]
    columns, warps = SUM_TILE
    return sum_pairs(
        y,
        flat_ids,
        out,
        experts,
        slots=slots,
        weights=topk_weights.reshape(-1),
        columns=columns,
        warps=warps,
    )


def group_pairs(
    flat_ids: torch.Tensor, experts: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The pairs [rows * k] grouped by expert on the device: (order, the pairs in group order;
    offsets [experts] int32, each group's end row, the grouped GEMM's `offs`; slots, pair p's
    row in that order). Pairs of no expert (id outside [0, experts)) sort past the last group."""
    absent = (flat_ids < 0) | (flat_ids >= experts)
    keys = flat_ids.masked_fill(absent, experts)  # absent pairs in a last group of their own
    # A radix sort's passes go by the key's width: int16 keys (any expert count below 2^15)
    # take two where int64 takes eight (docs/benchmarks.md, "Prefill at 47.2%").
    narrow = keys.to(torch.int16) if experts < 2**15 else keys
    sorted_keys, order = torch.sort(narrow, stable=True)
    # End row of each expert's group: the sorted keys at or below it, one binary search per
    # expert, on the device (bincount reads the max id back to the host; a scatter-add of ones
    # contends on a few bins, and wants a zeroed buffer and a cumsum around it). The last end is
    # where the absent pairs start.
    bounds = torch.arange(experts, dtype=narrow.dtype, device=flat_ids.device)
    offsets = torch.searchsorted(sorted_keys, bounds, right=True, out_int32=True)
    slots = torch.empty_like(order)
    slots.scatter_(0, order, torch.arange(order.numel(), device=flat_ids.device))
    return order, offsets, slots
