"""The kernels the model calls. Each name resolves to the plain-torch reference; a GPU fast path
replaces it only for CUDA tensors and only where a test compares it against the reference."""

from __future__ import annotations

import torch

from afdserve.kernels import reference
from afdserve.kernels.reference import AttentionMetadata


def write_kv(cache: torch.Tensor, values: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    reference.write_kv(cache, values, slot_mapping)


def paged_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    meta: AttentionMetadata,
    scale: float,
) -> torch.Tensor:
    return reference.paged_attention(q, k_cache, v_cache, meta, scale)


def moe_experts(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: torch.Tensor,
    down: torch.Tensor,
) -> torch.Tensor:
    return reference.moe_experts(x, topk_ids, topk_weights, gate_up, down)
