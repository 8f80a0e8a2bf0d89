"""DeepSeek-V4's quantized checkpoints in the model: which modules hold FP8, the FP4 routed
experts, and the loader's dtype rules for both (docs/design.md, "DeepSeek-V4's checkpoint
precision").

DeepSeek-V4-Flash's checkpoint keeps in FP8 (float8_e4m3fn, a ue8m0 scale per 128 x 128 block,
`<module>.scale`) the attention projections `wq_a`, `wq_b`, `wkv`, `wo_a`, `wo_b`, the indexer's
`wq_b` and the shared expert; in FP4 (`expert_dtype: "fp4"`: e2m1 pairs in int8, a ue8m0 scale
per 32 inputs) the routed experts; in bf16 everything else, the compressors' and the indexer's
`weights_proj` included (transformers' `_keep_in_fp32_modules` lists the same five). In memory:
FP8 weights stay float8_e4m3fn beside float32 scale grids (ue8m0 widens exactly), so they take
the FP8 path every family takes (model/layers/fp8.py); FP4 experts stay packed bytes beside their
scale bytes (`Fp4Experts`), read by kernels/reference/fp4.py on the CPU and
kernels/moe/fp4_decode.py on CUDA.
"""

from __future__ import annotations

import re

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.ops import FP4_BLOCK, as_bytes, e8m0_to_float, scale_problem
from afdserve.model.config import ModelConfig
from afdserve.model.families.deepseek_v4 import names
from afdserve.model.layers.fp8 import SCALE_SUFFIX, Fp8Linear, load_problem, quantize_experts
from afdserve.model.layers.moe import Experts, Routing
from afdserve.model.quantization import Fp8Spec

# Our names of the linear layers the public checkpoint stores in FP8.
FP8_MODULES = re.compile(
    r"\.(self_attn\.(q_a_proj|q_b_proj|kv_proj|o_a_proj|o_b_proj|compressor\.indexer\.q_b_proj)"
    r"|mlp\.shared_experts\.(gate_proj|up_proj|down_proj)|e_proj|h_proj)$"
)
E8M0_DTYPES = (torch.float8_e8m0fnu, torch.uint8)  # ue8m0 scales, or their bytes (MXFP8 style)
FP4_DTYPES = (torch.int8, torch.uint8, torch.float4_e2m1fn_x2)  # int8 as published
PACKED_ONLY = (torch.int8, torch.float4_e2m1fn_x2)  # dtypes no unquantized weight has


class Fp4Experts(Experts):
    """Routed experts in FP4: `gate_up_proj` [E, 2I, H / 2] and `down_proj` [E, H, I / 2] packed
    e2m1 pairs, `*_scale_inv` [E, 2I, H / 32] and [E, H, I / 32] their ue8m0 scales, all uint8
    (the names transformers' FP8Experts gives them too)."""

    def __init__(self, config: ModelConfig, held: tuple[int, ...] | None = None) -> None:
        super().__init__(config, held)
        h, i = config.hidden_size, config.moe_intermediate_size
        e, device = self.gate_up_proj.shape[0], self.gate_up_proj.device
        for name, rows, cols in (("gate_up_proj", 2 * i, h), ("down_proj", h, i)):
            for suffix, width in (("", cols // 2), (SCALE_SUFFIX, cols // FP4_BLOCK)):
                setattr(
                    self,
                    name + suffix,
                    nn.Parameter(
                        torch.empty(e, rows, width, dtype=torch.uint8, device=device),
                        requires_grad=False,
                    ),
                )

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
        )


def _public_module(name: str) -> str:
    return names.to_public(name + ".weight").removesuffix(".weight")


def convert_to_quantized(model: nn.Module, config: ModelConfig) -> None:
    """Turn the FP8 modules of a V4 half into Fp8Linear and its routed experts into FP4 (or FP8)
    stacks, in place, before the model has storage (on meta), less modules_to_not_convert (read
    in either spelling)."""
    spec = config.quantization
    if spec.online:
        raise ValueError(
            "quantization='fp8' on a deepseek_v4 checkpoint without quantization_config is not "
            "supported: V4 is read in its published precision (FP8 projections, FP4 or FP8 "
            "experts, as its quantization_config says); allowed: None"
        )
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if not spec.converts(name, _public_module(name)):
                continue
            if isinstance(child, nn.Linear) and FP8_MODULES.search(name):
                setattr(
                    parent,
                    child_name,
                    Fp8Linear(
                        child.in_features,
                        child.out_features,
                        False,
                        spec.block,
                        child.weight.device,
                    ),
                )
            elif isinstance(child, Experts) and spec.expert_dtype == "fp4":
                setattr(parent, child_name, Fp4Experts(config, child.held))
            elif isinstance(child, Experts):
                quantize_experts(child, spec.block)


def load_problem_v4(
    name: str, target: str, src: torch.Tensor, dst: torch.Tensor, spec: Fp8Spec | None
) -> str | None:
    """Why checkpoint tensor `name` (our `target`) cannot fill `dst` (None: it can): FP4 bytes
    and ue8m0 scales, then the FP8 rules every family has."""
    scale = target.endswith(SCALE_SUFFIX)
    if dst.dtype == torch.uint8:  # an FP4 expert stack: packed pairs or their scale bytes
        ok, what = (
            (E8M0_DTYPES, "ue8m0 scales (float8_e8m0fnu or uint8), one per 32 inputs")
            if scale
            else (
                FP4_DTYPES,
                "packed e2m1 pairs (int8 as published, uint8 or "
                "float4_e2m1fn_x2), two inputs per byte",
            )
        )
        if src.dtype not in ok:
            return (
                f"{name}: dtype {src.dtype} for an FP4 expert (expert_dtype='fp4'); expected {what}"
            )
        return scale_problem(name, src) if scale else None
    if src.dtype in PACKED_ONLY and ".experts." in target:
        return (
            f"{name}: dtype {src.dtype} (FP4-packed experts) in a checkpoint whose "
            "config.json does not say expert_dtype='fp4'"
        )
    fp8_expert_grid = scale and ".experts." in target and dst.dim() == 3
    if fp8_expert_grid and src.dim() == 2 and src.shape[0] > dst.shape[1]:
        return (
            f"{name}: shape {tuple(src.shape)}, an FP4 expert's scales (one per 32 inputs), in a "
            "checkpoint whose config.json does not say expert_dtype='fp4'; FP8 experts have one "
            f"scale per 128x128 block ({tuple(dst.shape[1:])} for gate and up together)"
        )
    if scale and src.dtype in E8M0_DTYPES:
        if spec is None or spec.scale_fmt != "ue8m0":
            return (
                f"{name}: dtype {src.dtype} (ue8m0 scale bytes) but quantization_config."
                f"scale_fmt={getattr(spec, 'scale_fmt', None)!r}; allowed: float32 scales, "
                "or ue8m0 bytes with scale_fmt='ue8m0'"
            )
        return None
    if scale and src.dtype != torch.float32:
        return (
            f"{name}: dtype {src.dtype} for a block scale; allowed: float8_e8m0fnu "
            "(ue8m0) or float32"
        )
    return load_problem(name, src, dst, spec)


def stored_form(src: torch.Tensor, dst: torch.Tensor, target: str) -> torch.Tensor:
    """The checkpoint tensor as the model holds it: FP4 stacks as bytes, ue8m0 scales of FP8
    weights widened to float32 (exact: powers of two)."""
    if dst.dtype == torch.uint8:
        return as_bytes(src)
    if target.endswith(SCALE_SUFFIX) and src.dtype in E8M0_DTYPES:
        return e8m0_to_float(src)
    return src
