"""The paged cache of one attention rank, as the model's `CacheLayout` describes it
(model/cache.py): the engine sizes, allocates and checks it without knowing the family.

Its dtype is the model's (kv_cache_dtype="auto") or float8_e4m3fn ("fp8", vLLM's alias
"fp8_e4m3"): half a bf16 cache's bytes per token, so the same memory holds twice the tokens. The
FP8 cache's per-tensor scales are the attention layers' (model/layers/attention.py), 1.0.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from afdserve.model.cache import PagedCache
from afdserve.model.config import ModelConfig
from afdserve.model.families import cache_layout

FP8_KV_DTYPES = ("fp8", "fp8_e4m3")
KV_SCALE_SUFFIXES = (".k_scale", ".v_scale", ".kv_scale")  # vLLM's and ModelOpt's names


def cache_dtype(kv_cache_dtype: str, model_dtype: torch.dtype) -> torch.dtype:
    """The torch dtype of the cache that EngineConfig.kv_cache_dtype names."""
    return torch.float8_e4m3fn if kv_cache_dtype in FP8_KV_DTYPES else model_dtype


def check_fp8_kv(
    config: ModelConfig, device: torch.device, checkpoint_names: Iterable[str] = ()
) -> None:
    """Refuses, by name, what the FP8 cache is not built for: pages the layout says cannot be
    FP8, CUDA devices without e4m3 conversions (before compute capability 8.9), and checkpoints
    that carry per-layer KV scales (they would be silently replaced by 1.0)."""
    why = cache_layout(config).fp8_refusal
    if why is not None:
        raise ValueError(
            f"EngineConfig.kv_cache_dtype='fp8' is not supported for family {config.family!r}: "
            f"{why}; use kv_cache_dtype='auto'"
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
    """Bytes every layer of the model holds per block of `block_size` positions."""
    return cache_layout(config).bytes_per_block(block_size, dtype)


def make_kv_cache(
    config: ModelConfig,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device | str,
    num_slots: int = 0,
    num_window_blocks: int | None = None,
    shared_slots: bool = False,
) -> PagedCache:
    """The model's paged cache over `num_blocks` blocks, each layer's pages as its spec says,
    `num_slots` sequence slots where the layout keeps a state per sequence (`shared_slots`: in
    the blocks' pages), and the windowed layers' own pool of `num_window_blocks` (None: they
    share `num_blocks`)."""
    layout = cache_layout(config)
    return layout.allocate(
        num_blocks, block_size, dtype, device, num_slots, num_window_blocks, shared_slots
    )


def window_pool_bound(
    window: int, block_size: int, max_num_seqs: int, max_num_batched_tokens: int
) -> int:
    """The most blocks the windowed layers' pool can hold at once, its null block included. A
    sequence whose step writes n positions from c holds the blocks of [c - window + 1, c + n):
    at most ceil((window - 1) / B) + ceil(n / B) + 1 <= ceil((window - 1) / B) + n / B + 2, and
    a step writes at most max_num_batched_tokens positions over at most max_num_seqs
    sequences. (Blocks a rejected draft left past a sequence's end may exceed it; the scheduler
    then preempts as for the other pool.)"""
    past = -(-(window - 1) // block_size)
    return 1 + max_num_seqs * (past + 2) + -(-max_num_batched_tokens // block_size)


def slots_for(config: ModelConfig, max_num_seqs: int, dtype: torch.dtype) -> int:
    """Sequence slots the cache needs: one per sequence the scheduler may run, or none where
    the layout keeps no state per sequence."""
    return max_num_seqs if cache_layout(config).bytes_per_slot(dtype) else 0
