"""Routed experts as two grouped GEMMs (`torch.nn.functional.grouped_mm`), with no host sync.

Rows are sorted by expert on the device; per-expert row counts become the grouped GEMM's offsets,
so the number of rows each expert gets never reaches the host (the reference's `.tolist()` does).
Experts that get no rows are skipped by the grouped kernel: a decode step reads only the experts
its batch touches. `ops.moe_experts` uses this path above `triton_moe.MAX_PAIRS` (token, expert)
pairs; below it, the Triton decode kernels measured faster (docs/benchmarks.md).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def supports(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """grouped_mm runs bf16 only; its operands need 16-byte aligned rows."""
    if not hasattr(F, "grouped_mm"):
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
    """Same contract as `reference.moe_experts`. x [rows, hidden] bf16."""
    rows, top_k = topk_ids.shape
    experts = gate_up.shape[0]
    flat_ids = topk_ids.reshape(-1)
    order = torch.argsort(flat_ids, stable=True)  # [rows * k] picks grouped by expert
    token_of = order // top_k
    # bincount on CUDA reads the max id back to the host; a scatter-add does not.
    counts = torch.zeros(experts, dtype=torch.int32, device=x.device)
    counts.scatter_add_(0, flat_ids, torch.ones_like(flat_ids, dtype=torch.int32))
    offsets = torch.cumsum(counts, dim=0, dtype=torch.int32)  # end row of each expert's group
    sorted_x = x.index_select(0, token_of)  # [rows * k, hidden]
    # grouped_mm computes a @ b per group with b [E, K, N]: the stored [E, N, K] weights transposed.
    gate, up = F.grouped_mm(sorted_x, gate_up.transpose(1, 2), offs=offsets).chunk(2, dim=-1)
    y = F.grouped_mm(F.silu(gate) * up, down.transpose(1, 2), offs=offsets)  # [rows * k, hidden]
    weights = topk_weights.reshape(-1).index_select(0, order).unsqueeze(-1)
    out = torch.zeros_like(x)
    out.index_add_(0, token_of, (y.float() * weights).to(x.dtype))
    return out
