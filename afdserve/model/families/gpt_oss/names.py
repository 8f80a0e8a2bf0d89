"""gpt-oss's checkpoint names and layouts -> afdserve's, for the loader.

The published checkpoints keep experts stacked as transformers' GptOssExperts holds them:
`gate_up_proj` [E, H, 2I] with gate and up columns interleaved (gate 2j, up 2j + 1) and its bias
[E, 2I] likewise, `down_proj` [E, I, H]. The MXFP4 form stores the same matrices transposed,
[E, out, in / 32, 16] bytes of e2m1 pairs (`_blocks`, low nibble first) and [E, out, in / 32]
ue8m0 scales (`_scales`): byte for byte DeepSeek-V4's FP4 layout once the last two dims are
flattened. afdserve holds `gate_up_proj` [E, 2I, H] (gate rows, then up rows) and `down_proj`
[E, H, I] (or their FP4 bytes and `_scale_inv`); the interleaving becomes a row permutation,
exact. The router is `mlp.router` on disk and `mlp.gate` here.
"""

from __future__ import annotations

import torch

from afdserve.model.layers.fp8 import SCALE_SUFFIX

_EXPERTS = ".mlp.experts."


def to_ours(name: str) -> str:
    """A checkpoint tensor's name -> the model's."""
    name = name.replace(".mlp.router.", ".mlp.gate.")
    if _EXPERTS in name:
        name = name.replace("_blocks", "").replace("_scales", SCALE_SUFFIX)
    return name


def to_public(name: str, mxfp4: bool) -> str:
    """The model's name -> the checkpoint's (for messages about missing tensors)."""
    name = name.replace(".mlp.gate.", ".mlp.router.")
    if mxfp4 and _EXPERTS in name and not name.endswith("_bias"):
        if name.endswith(SCALE_SUFFIX):
            return name.removesuffix(SCALE_SUFFIX) + "_scales"
        return name + "_blocks"
    return name


def _deinterleave(t: torch.Tensor, dim: int) -> torch.Tensor:
    """Gate (even) and up (odd) entries along `dim` -> gate half, then up half."""
    pairs = t.unflatten(dim, (-1, 2))
    return torch.cat((pairs.select(dim + 1, 0), pairs.select(dim + 1, 1)), dim=dim)


def stored_form(name: str, tensor: torch.Tensor) -> torch.Tensor:
    """Checkpoint tensor `name` in the layout of the model tensor it fills."""
    if _EXPERTS not in name:
        return tensor
    gate_up = ".gate_up_proj" in name
    if name.endswith("_blocks"):  # [E, out, in / 32, 16] -> [E, out, in / 2]
        tensor = tensor.flatten(-2)
    elif not name.endswith(("_scales", "_bias")):  # bf16 [E, in, out] -> [E, out, in]
        tensor = tensor.transpose(-1, -2)
    if gate_up:  # the out dim: rows of a weight, entries of a bias
        tensor = _deinterleave(tensor, 1)
    return tensor.contiguous()
