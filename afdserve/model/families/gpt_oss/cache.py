"""gpt-oss's per-sequence state: keys and values per KV head in every layer, as the decoder
families' `PagedKV`; the sliding-window layers as a group of their own kind ("sliding").

A sliding layer reads only its window (the last `window` positions), so its spec declares the
window (`CacheSpec.window`): the engine keeps those layers' pages in a pool of their own,
addressed through a second block table per sequence, and frees the blocks that fall behind the
window as the sequence advances (engine/block_manager.py). At long context the sliding half of
the layers then costs a few blocks per sequence instead of the whole context.
"""

from __future__ import annotations

from dataclasses import dataclass

from afdserve.model.cache import CacheLayout, PagedKV
from afdserve.model.config import ModelConfig


@dataclass(frozen=True)
class SlidingKV(PagedKV):
    """`PagedKV` of sliding-window layers: a query at p reads positions p - window < j <= p."""

    kind: str = "sliding"
    window: int | None = None


def cache_layout(config: ModelConfig) -> CacheLayout:
    family = config.family_config
    heads, dim = config.num_kv_heads, config.head_dim
    specs = []
    if family.full_layers:
        specs.append(PagedKV(family.full_layers, heads, dim))
    if family.sliding_layers:
        specs.append(SlidingKV(family.sliding_layers, heads, dim, window=family.sliding_window))
    return CacheLayout(tuple(specs), config.num_layers)
