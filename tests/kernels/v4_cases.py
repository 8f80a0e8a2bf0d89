"""What DeepSeek-V4's interpreted kernel cases share (tests/kernels/test_v4_*_interpret.py import
it inside their subprocess scripts): the layer types and the tiny V4 they run on."""

from __future__ import annotations

from pathlib import Path

import torch

from afdserve.model.checkpoint.loader import load_model
from afdserve.model.fixtures.deepseek_v4 import make_tiny_v4
from afdserve.model.parts import ModelParts

CSA, HCA = "compressed_sparse_attention", "heavily_compressed_attention"
SLIDING = "sliding_attention"


def models_of(root: str, name: str, **overrides) -> dict[torch.dtype, torch.nn.Module]:
    """A tiny V4 (sliding, CSA, HCA, CSA) with the same weights in float32 and float16 (mHC,
    biases and norms stay float32, as loaded): float16, as the interpreter computes bf16 wrongly."""
    path = make_tiny_v4(
        Path(root) / name, seed=3, layer_types=[SLIDING, CSA, HCA, CSA], **overrides
    )
    return {
        dtype: load_model(path, ModelParts.colocated(), str(dtype)[6:])[0]
        for dtype in (torch.float32, torch.float16)
    }


def projected(model: torch.nn.Module, layer: int, prefix: str, x: torch.Tensor):
    """The (kv, gate) `batched._compress` takes for `prefix`'s compressor of `layer` ("" its own,
    "index_" its indexer's): column slices of the packed GEMM's output, as the engine runs it."""
    own, index = model.model.layers[layer].self_attn.compressor.project(x)
    kv, gate = index[:2] if prefix else own
    assert kv.stride(0) > kv.shape[1], "the loader packs the compressors' projections"
    return kv, gate
