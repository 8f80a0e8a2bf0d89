"""The paged KV cache of one attention rank: per layer `[num_blocks, block_size, heads, dim]`."""

from __future__ import annotations

import torch

from afdserve.model.config import ModelConfig


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    per_token = config.num_cache_heads * config.kv_cache_dim
    tensors = 1 if config.attention == "mla" else 2  # MLA caches one latent, GQA keys and values
    return config.num_layers * tensors * block_size * per_token * dtype.itemsize


class KVCache:
    def __init__(
        self,
        config: ModelConfig,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, config.num_cache_heads, config.kv_cache_dim)
        self.layers: list[tuple[torch.Tensor, torch.Tensor | None]] = []
        for _ in range(config.num_layers):
            first = torch.zeros(shape, dtype=dtype, device=device)
            second = (
                None
                if config.attention == "mla"
                else torch.zeros(shape, dtype=dtype, device=device)
            )
            self.layers.append((first, second))
        self.bytes = bytes_per_block(config, block_size, dtype) * num_blocks
