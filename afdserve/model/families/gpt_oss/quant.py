"""gpt-oss's MXFP4 checkpoints: the routed experts as FP4 (e2m1 pairs, a ue8m0 scale per 32
inputs), everything else unquantized (`modules_to_not_convert` names the attention, router,
embeddings and head). The arithmetic is DeepSeek-V4's FP4 experts': the same stacks
(`Fp4Experts`), reference and kernels, with gpt-oss's biases and gain (`ops.ExpertGLU`)."""

from __future__ import annotations

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.ops import scale_problem
from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4.quant import Fp4Experts
from afdserve.model.layers.fp8 import SCALE_SUFFIX
from afdserve.model.layers.moe import Experts, Routing


class GptOssFp4Experts(Fp4Experts):
    """`Fp4Experts` plus `gate_up_proj_bias` [E, 2I] and `down_proj_bias` [E, H] in the model
    dtype (MXFP4 leaves the biases unquantized)."""

    def __init__(self, config: ModelConfig, held: tuple[int, ...] | None = None) -> None:
        super().__init__(config, held)
        e, i, h = self.gate_up_proj.shape[0], config.moe_intermediate_size, config.hidden_size
        self.gate_up_proj_bias = nn.Parameter(torch.empty(e, 2 * i))
        self.down_proj_bias = nn.Parameter(torch.empty(e, h))
        self.alpha = config.family_config.swiglu_alpha

    def forward(self, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        ids, weights = routing
        if self.held is not None:  # as Experts.forward: held elsewhere or pad -> -1
            ids = torch.where(ids >= 0, self.local_index[ids.clamp(min=0)], -1)
        return ops.moe_experts_fp4(
            x,
            ids,
            weights,
            (self.gate_up_proj, self.gate_up_proj_scale_inv),
            (self.down_proj, self.down_proj_scale_inv),
            self.limit,
            ops.ExpertGLU(self.gate_up_proj_bias, self.down_proj_bias, self.alpha),
        )


def convert_to_mxfp4(model: nn.Module, config: ModelConfig) -> None:
    """Turn every expert stack of a gpt-oss half into FP4, in place, on meta. Online FP8 (the
    engine's quantization='fp8' on a bf16 checkpoint) is refused: gpt-oss is published in
    MXFP4, which afdserve reads as it is."""
    spec = config.quantization
    if spec.online or spec.expert_dtype != "fp4":
        raise ValueError(
            "quantization='fp8' on a gpt_oss checkpoint is not supported: gpt-oss is read in "
            "its published precision (MXFP4 experts, as its quantization_config says, or bf16 "
            "throughout); allowed: None"
        )
    for parent in list(model.modules()):
        for child_name, child in list(parent.named_children()):
            if isinstance(child, Experts):
                setattr(parent, child_name, GptOssFp4Experts(config, child.held))


def load_problem(name: str, src: torch.Tensor, dst: torch.Tensor) -> str | None:
    """Why checkpoint tensor `name` cannot fill `dst` (None: it can): FP4 bytes and ue8m0 scales
    must be uint8, as published; an unquantized tensor must not be."""
    if dst.dtype == torch.uint8:
        scale = name.endswith("_scales")
        what = "ue8m0 scales" if scale else "packed e2m1 pairs"
        if src.dtype != torch.uint8:
            return (
                f"{name}: dtype {src.dtype} for an MXFP4 expert tensor; expected uint8 ({what}, "
                "as quant_method='mxfp4' stores them)"
            )
        return scale_problem(name, src) if scale else None
    if src.dtype == torch.uint8:
        return (
            f"{name}: uint8 (MXFP4 bytes) in a checkpoint whose config.json has no "
            "quantization_config with quant_method='mxfp4'"
        )
    if name.endswith(SCALE_SUFFIX):
        return f"{name}: a block scale in a gpt_oss checkpoint, which has none"
    return None
