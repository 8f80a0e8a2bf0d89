"""DSA's pages: per block, MLA's latent rows and the lightning indexer's key rows.

A layer that runs its own indexer caches, for every position, the latent `[kv_lora_rank +
qk_rope_head_dim]` the attention reads and the indexer key `[index_head_dim]` the indexer scores;
a GLM-5 "shared" layer reuses an earlier layer's selection and caches the latent alone. Both rows
of a position depend only on the tokens up to it, so full blocks are reused by prefix hash like any
MLA cache's, and an FP8 cache stores both as float8_e4m3fn at scale 1.0 (the indexer key is
LayerNorm's output, well inside e4m3's range).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from afdserve.kernels import ops
from afdserve.kernels.metadata import AttentionMetadata
from afdserve.model.cache import CacheLayout, CacheSpec
from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4.rows import StepRows

# Why "auto" keeps DSA eager on CUDA without Triton: the torch path's captured decode scores
# every row against the indexer keys of max_model_len positions (the graph's block-table width),
# rows x positions x index_head_dim. The Triton kernels score and rank each row only up to its
# own position (blocks past it are skipped inside the graph), so with them "auto" captures.
EAGER_BY_DEFAULT = (
    "without Triton a captured DSA decode scores each row over max_model_len positions of "
    "indexer keys (the graph's block-table width); ask for graph_mode='full_decode_only' with a "
    "max_model_len that keeps that small"
)
# Why "full" is refused without Triton: a mixed graph launches queries as long as the ubatch, and
# the torch path's captured selection gathers every row's indexer keys out to max_model_len, rows
# x max_model_len x index_head_dim. With the kernels a prefill row is a row like a decode one
# (its own table, read up to its own position), so `full` captures mixed steps there.
FULL_GRAPH_REFUSAL = (
    "without Triton a captured DSA step gathers every row's indexer keys out to max_model_len "
    "(prefill chunks included); use graph_mode='full_decode_only'"
)


@dataclass(frozen=True)
class DSAPages(CacheSpec):
    """Per layer `(latent [blocks, B, 1, latent_dim], index_keys [blocks, B, 1, index_dim])`,
    `index_keys` None where the layers run no indexer (`index_dim` 0)."""

    layers: tuple[int, ...]
    latent_dim: int
    index_dim: int
    kind: str = "DSA"
    graph_refusals: tuple[tuple[str, str], ...] = (("full", FULL_GRAPH_REFUSAL),)
    eager_by_default: str | None = EAGER_BY_DEFAULT
    # The indexer of every layer reads a ubatch's rows alike: one StepRows for all of them.
    step_metadata_per_type = True

    def step_metadata(self, meta: AttentionMetadata) -> StepRows | None:
        return StepRows.of_ubatch(meta)

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        return block_size * (self.latent_dim + self.index_dim) * dtype.itemsize

    def allocate(self, num_blocks, block_size, dtype, device) -> list[Any]:
        def pages(dim: int) -> torch.Tensor | None:
            if dim == 0:
                return None
            return torch.zeros(num_blocks, block_size, 1, dim, dtype=dtype, device=device)

        return [(pages(self.latent_dim), pages(self.index_dim)) for _ in self.layers]


def cache_layout(config: ModelConfig) -> CacheLayout:
    """Layers that run their indexer in one group (latent and keys), GLM-5's shared ones in
    another (latent only). Where the Triton kernels load `auto` captures decode, `full` mixed
    steps too."""
    dsa = config.family_config
    latent = config.kv_lora_rank + config.qk_rope_head_dim
    full = tuple(i for i in range(config.num_layers) if dsa.has_indexer(i))
    shared = tuple(i for i in range(config.num_layers) if not dsa.has_indexer(i))
    triton = ops.triton_available()
    policy = dict(
        eager_by_default=None if triton else EAGER_BY_DEFAULT,
        graph_refusals=() if triton else (("full", FULL_GRAPH_REFUSAL),),
    )
    specs = [DSAPages(full, latent, dsa.index_head_dim, **policy)]
    if shared:
        specs.append(DSAPages(shared, latent, 0, kind="MLA", **policy))
    return CacheLayout(tuple(specs), config.num_layers)
