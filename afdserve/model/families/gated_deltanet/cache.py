"""The Gated DeltaNet hybrids' cache: paged keys and values for the full-attention layers, and a
state slot per sequence for the linear-attention layers (model/cache.py's `SequenceSlots`).

A linear layer's state does not grow with the context: the delta rule's matrix per value head,
[heads, key_dim, value_dim] float32 (the precision transformers' reference keeps it in), and the
short convolution's last K - 1 inputs, [conv_dim, K - 1] in the cache dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.cache import CacheLayout, PagedKV, SequenceSlots
from afdserve.model.config import ModelConfig
from afdserve.model.families.gated_deltanet.config import FULL, LINEAR, GDNConfig
from afdserve.model.families.gated_deltanet.spans import DeltaSpans
from afdserve.model.slot_plan import Part

PREFIX_REUSE_REFUSAL = (
    "a linear-attention layer keeps one recurrent state per sequence, not per block, so a cached "
    "block holds no state to resume from (snapshots at block boundaries are not implemented)"
)
FP8_REFUSAL = "its recurrent state and convolution window are not quantized"


@dataclass
class LinearState:
    """One linear layer's slots: `conv` [slots, conv_dim, K - 1], and `delta` [slots, hv, dk,
    dv], a view of a part one slot longer (`delta_all`): that last slot, the scratch, is where
    the torch decode step (kernels/reference/delta_rule.py) sends the writes of entries of slot
    -1 (segments that do not step, pad segments), so they never land in a sequence's state (the
    kernels skip them). It is never read as state; the cache's bytes count the slots only. Where
    the slots live in the full layers' pages (model/cache.py's `SlotPlan`), a slot's stride is
    not its size; each slot's own tensor is contiguous."""

    conv: torch.Tensor
    delta_all: torch.Tensor

    @property
    def delta(self) -> torch.Tensor:
        return self.delta_all[:-1]


@dataclass(frozen=True)
class DeltaNetState(SequenceSlots):
    """The linear layers of a delta-rule family (Gated DeltaNet; Kimi Delta Attention too)."""

    layers: tuple[int, ...]
    conv_dim: int
    conv_kernel: int
    heads: int  # value heads
    key_head_dim: int
    value_head_dim: int
    kind: str = "GDN"
    fp8_refusal = FP8_REFUSAL
    # The layers run from the device segments on every device (spans.py), so the CPU runs what
    # a graph captures.
    batched_segments = True

    def slot_parts(self, dtype: torch.dtype) -> tuple[Part, ...]:
        return (
            ((self.conv_dim, self.conv_kernel - 1), dtype),
            ((self.heads, self.key_head_dim, self.value_head_dim), torch.float32),
        )

    def layer_cache(self, parts: tuple[torch.Tensor, ...]) -> LinearState:
        conv, delta = parts
        return LinearState(conv[:-1], delta)

    @staticmethod
    def tensors(layer_cache: LinearState):
        yield from (layer_cache.conv, layer_cache.delta)

    def prefix_reuse_refusal(self, block_size: int) -> str | None:
        return PREFIX_REUSE_REFUSAL

    def step_metadata(self, meta: AttentionMetadata) -> DeltaSpans:
        return DeltaSpans.of(meta)


def cache_layout(config: ModelConfig) -> CacheLayout:
    gdn: GDNConfig = config.family_config
    full = PagedKV(gdn.layers_of(FULL), config.num_kv_heads, config.head_dim)
    state = DeltaNetState(
        gdn.layers_of(LINEAR),
        gdn.conv_dim,
        gdn.conv_kernel,
        gdn.num_value_heads,
        gdn.key_head_dim,
        gdn.value_head_dim,
    )
    return CacheLayout(tuple(s for s in (full, state) if s.layers), config.num_layers)
