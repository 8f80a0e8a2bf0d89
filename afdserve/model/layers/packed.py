"""Linear layers that read the same rows, run as one GEMM: GQA's q/k/v, every GatedMLP's gate and
up, DeepSeek-V4's q_a and kv, CSA's two q_b, and its compressors' kv and gate (with the
indexer's kv, gate and head weights). One [sum of outs, in] matrix takes a launch (and, in FP8,
one quantize of the rows) where there were several. The layers' parameters become views of it,
so checkpoints still load, and state dicts still read, by the Hugging Face names; the loader
packs once the weights are allocated, before they load (checkpoint/loader.py's materialize)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.ops import Fp8Rows


def _block_scaled(layer: nn.Module) -> bool:
    """An `Fp8Linear` (model/layers/fp8.py, known by its parts: that module imports the MoE
    layers, which import the dense MLP that packs here)."""
    return getattr(layer, "weight_scale_inv", None) is not None and hasattr(layer, "block")


@dataclass(frozen=True)
class PackedLinear:
    """The packed matrix: `weight` [sum of outs, in] (FP8: with `scale_inv`, its scale grid, at
    `block`), `bias` or None, `sizes` each layer's outs in order."""

    weight: torch.Tensor
    scale_inv: torch.Tensor | None
    bias: torch.Tensor | None
    block: tuple[int, int] | None
    sizes: tuple[int, ...]

    @staticmethod
    def of(layers: Sequence[nn.Module]) -> PackedLinear | None:
        """Pack `layers` (their parameters become views of the packed ones), or None where they
        cannot share one matrix: kinds mixed, biases on some only, or FP8 layers whose rows do
        not each end on a scale block (their grids would not stack)."""
        if all(_block_scaled(layer) for layer in layers):
            block = layers[0].block
            if any(layer.block != block or layer.out_features % block[0] for layer in layers):
                return None
            names = ("weight", "weight_scale_inv", "bias")
        elif all(type(layer) is nn.Linear for layer in layers):
            block, names = None, ("weight", "bias")
        else:
            return None
        if len({layer.bias is None for layer in layers}) > 1:
            return None
        packed: dict[str, torch.Tensor | None] = {}
        for name in names:
            tensors = [getattr(layer, name) for layer in layers]
            if tensors[0] is None:
                packed[name] = None
                continue
            whole = torch.cat([t.detach() for t in tensors])
            for layer, view in zip(layers, whole.split([t.shape[0] for t in tensors]), strict=True):
                setattr(layer, name, nn.Parameter(view, requires_grad=False))
            packed[name] = whole
        sizes = tuple(layer.out_features for layer in layers)
        scale = packed.get("weight_scale_inv")
        return PackedLinear(packed["weight"], scale, packed["bias"], block, sizes)

    def __call__(self, x: torch.Tensor | Fp8Rows) -> torch.Tensor:
        """The layers' outputs side by side [rows, sum of outs]."""
        if self.scale_inv is not None:
            return ops.fp8_linear(x, self.weight, self.scale_inv, self.bias, self.block)
        return F.linear(x, self.weight, self.bias)

    def split(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """Each layer's output: column slices of one GEMM's [rows, sum of outs] (rows strided)."""
        return self(x).split(self.sizes, dim=-1)

    def takes_fp8_rows(self, h: torch.Tensor) -> bool:
        """Whether the norm before may hand these layers h's rows quantized for their FP8 GEMM
        (ops.quantizes_for_gemm), saving that GEMM's quantize launch."""
        if self.scale_inv is None:
            return False
        return ops.quantizes_for_gemm(h, self.weight, self.scale_inv, self.block)
