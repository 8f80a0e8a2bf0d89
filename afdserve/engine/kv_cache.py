"""The paged KV cache of one attention rank: per layer `[num_blocks, block_size, heads, dim]`.

Its dtype is the model's (kv_cache_dtype="auto") or float8_e4m3fn ("fp8", vLLM's alias
"fp8_e4m3"): half a bf16 cache's bytes per token, so the same memory holds twice the tokens. The
FP8 cache's per-tensor scales are the attention layers' (model/layers/attention.py), 1.0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4 import cache as v4_cache

FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")  # vLLM's and ModelOpt's names


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache that EngineConfig.kv_cache_dtype names."""
    return torch.float8_e4m3fn if kv_cache_dtype in FP8_KV_DTYPES else model_dtype


def check_fp8_kv(
    config: ModelConfig, device: torch.device, checkpoint_names: Iterable[str] = ()
) -> None:
    """Refuses, by name, what the FP8 cache is not built for: DeepSeek-V4 (its pages of windows,
    entries and compressor state are not quantized yet), CUDA devices without e4m3 conversions
    (before compute capability 8.9), and
    checkpoints that carry per-layer KV scales (they would be silently replaced by 1.0)."""
    if config.family == "deepseek_v4":
        raise ValueError(
            "EngineConfig.kv_cache_dtype='fp8' is not supported for family "
            "'deepseek_v4': its paged cache (windows, compressed entries, "
            "compressor state) is not quantized yet; use kv_cache_dtype='auto'"
        )
    if device.type == "cuda":
        major, minor = torch.cuda.get_device_capability(device)
        check_fp8_capability((major, minor), str(device))
    scales = sorted(n for n in checkpoint_names if n.endswith(KV_SCALE_SUFFIXES))
    if scales:
        shown = ", ".join(scales[:4]) + (f" ... ({len(scales)} in all)" if len(scales) > 4 else "")
        raise ValueError(
            f"EngineConfig.kv_cache_dtype='fp8': the checkpoint carries KV-cache scales ({shown}), "
            "which afdserve does not apply yet (its FP8 cache uses scale 1.0); use "
            "kv_cache_dtype='auto'"
        )


def check_fp8_capability(capability: tuple[int, int], device: str) -> None:
    if capability < (8, 9):
        raise ValueError(
            f"EngineConfig.kv_cache_dtype='fp8' needs a GPU of compute capability >= 8.9 (Ada, "
            f"Hopper) for its e4m3 conversions; {device} has {capability[0]}.{capability[1]}"
        )


def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    if config.v4 is not None:
        return v4_cache.bytes_per_block(config, block_size, dtype)
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
        self.num_blocks, self.block_size, self.dtype = num_blocks, block_size, dtype
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


def make_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
) -> KVCache | v4_cache.V4KVCache:
    """The family's paged cache over `num_blocks` blocks (DeepSeek-V4: pages per layer type,
    model/families/deepseek_v4/cache.py)."""
    if config.v4 is not None:
        return v4_cache.V4KVCache(config, num_blocks, block_size, dtype, device)
    return KVCache(config, num_blocks, block_size, dtype, device)
