"""gpt-oss's per-sequence state: keys and values per KV head in every layer, as the decoder
families' `PagedKV`; the sliding-window layers as a group of their own kind ("sliding").

A sliding layer reads only its window (the last `window` positions) of the engine's pages, but
holds every page the sequence's block table names: the engine gives a sequence one block table
shared by all layers (model/cache.py), so freeing the pages that fall out of a window would need
a table per group of layers or a ring per sequence. Until then a sliding layer costs as much
cache as a full one; its spec says which layers could give pages back.
"""

from __future__ import annotations

from dataclasses import dataclass

from afdserve.model.cache import CacheLayout, PagedKV
from afdserve.model.config import ModelConfig


@dataclass(frozen=True)
class SlidingKV(PagedKV):
    """`PagedKV` of sliding-window layers: a query at p reads positions p - window < j <= p."""

    kind: str = "sliding"
    window: int = 0


def cache_layout(config: ModelConfig) -> CacheLayout:
    family = config.family_config
    heads, dim = config.num_kv_heads, config.head_dim
    specs = []
    if family.full_layers:
        specs.append(PagedKV(family.full_layers, heads, dim))
    if family.sliding_layers:
        specs.append(SlidingKV(family.sliding_layers, heads, dim, window=family.sliding_window))
    return CacheLayout(tuple(specs), config.num_layers)
