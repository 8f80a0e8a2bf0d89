"""What each role of a deployment holds: its weights (counted from the model built on the meta
device, so every family and FP8 are counted as the engine allocates them) and the KV cache bytes
per token, from which the largest batch that fits follows."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.engine.kv_cache import bytes_per_block, window_pool_bound
from afdserve.model.checkpoint.loader import TORCH_DTYPES, _default_dtype
from afdserve.model.config import ModelConfig
from afdserve.model.families import cache_layout, model_class
from afdserve.model.parts import ModelParts

# Memory a rank uses besides weights and KV (activations, graph pools, the allocator's slack):
# 0.7-1.0 GB on the H200 in `afdserve bench capacity` (docs/benchmarks.md, 2026-11-30).
RESERVE_BYTES = 1 << 30
BLOCK_SIZE = 16  # the engine's default block size, which a windowed group's pages round to


@dataclass(frozen=True)
class ModelBytes:
    colocated: int  # every weight
    attention: int  # an attention rank's half (embedding, attention, norms, lm_head)
    ffn: int  # an FFN rank's half with every routed expert
    routed_experts: int  # of `ffn`, the routed experts' part (sharded by expert parallelism)
    kv_per_token: int  # of the layers that keep every position (not the windowed groups)
    # A sequence's fixed state, whatever its length: a linear-attention layer's slot
    # (model/cache.py's SequenceSlots; the blocks it takes where it lives in the pages) and a
    # windowed group's pages of one window and step.
    state_per_sequence: int = 0
    expert_bytes: int = 0  # one routed expert of one layer, as stored (FP8, FP4: their bytes)

    def ffn_shard(self, shards: int) -> float:
        """An FFN rank of an expert-parallel group of `shards`: its experts, the rest replicated."""
        return self.ffn - self.routed_experts + self.routed_experts / shards


def _half_bytes(config: ModelConfig, parts: ModelParts, dtype: torch.dtype) -> tuple[int, int, int]:
    """(every parameter and buffer, the routed experts' part, the layers holding experts)."""
    with _default_dtype(dtype), torch.device("meta"):
        model = model_class(config)(config, parts)
    total = experts = 0
    layers = set()
    for name, p in model.named_parameters():
        size = p.numel() * p.element_size()
        total += size
        if ".experts." in name or name.endswith((".experts.gate_up_proj", ".experts.down_proj")):
            experts += size
            layers.add(name.split(".experts")[0])
    for _, b in model.named_buffers():
        total += b.numel() * b.element_size()
    return total, experts, len(layers)


def model_bytes(
    config: ModelConfig, dtype: str = "bfloat16", kv_dtype: str | None = None
) -> ModelBytes:
    torch_dtype = TORCH_DTYPES[dtype]
    colocated, experts, expert_layers = _half_bytes(config, ModelParts.colocated(), torch_dtype)
    attention, _, _ = _half_bytes(config, ModelParts(True, False), torch_dtype)
    ffn, _, _ = _half_bytes(config, ModelParts(False, True), torch_dtype)
    one_expert = experts // max(1, expert_layers * config.num_experts)
    kv = getattr(torch, kv_dtype) if kv_dtype else torch_dtype
    layout = cache_layout(config)
    state = layout.bytes_per_slot(kv)
    if pages := layout.slot_pages(BLOCK_SIZE, kv):  # the slot lives in blocks' pages
        state = pages * layout.bytes_per_block(BLOCK_SIZE, kv)
    per_token = bytes_per_block(config, 1, kv) - layout.bytes_per_window_block(1, kv)
    if layout.window is not None:
        # A sequence's share of the window pool's bound (kv_cache.window_pool_bound) at one
        # sequence and one block a step: its past window and the blocks its step writes.
        blocks = window_pool_bound(layout.window, BLOCK_SIZE, 1, BLOCK_SIZE) - 1
        state += blocks * layout.bytes_per_window_block(BLOCK_SIZE, kv)
    return ModelBytes(colocated, attention, ffn, experts, per_token, state, one_expert)


def max_batch(
    memory_bytes: float,
    utilization: float,
    weights: float,
    kv_per_token: int,
    context: int,
    state_per_sequence: int = 0,
) -> int:
    """Sequences of `context` tokens whose KV (and fixed state) fits beside `weights` (0 when
    none does)."""
    room = memory_bytes * utilization - weights - RESERVE_BYTES
    return max(0, int(room // (kv_per_token * context + state_per_sequence)))
