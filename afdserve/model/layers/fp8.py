"""Block-scaled FP8 weights in the model: the checkpoint format, and the modules that hold them.

Published FP8 MoE checkpoints (DeepSeek-V3/R1, Kimi-K2, Qwen3-*-FP8) store each quantized linear
weight as float8_e4m3fn with a float32 `weight_scale_inv` per 128 x 128 block, as their
`quantization_config` (quant_method fp8, weight_block_size [128, 128]) says. Every linear
projection of attention, dense MLPs, shared and routed experts is FP8, less
`modules_to_not_convert`; embeddings, norms, routers and lm_head stay in the model dtype. The
weights stay FP8 in memory beside their scales; the CPU path dequantizes right before each matmul.
Stacked experts keep the layout: `experts.gate_up_proj` [E, 2I, H] with its scale grid
[E, 2 * ceil(I / 128), ceil(H / 128)] (gate's grid, then up's, each its own when I is no multiple
of 128), `experts.down_proj` [E, H, I] likewise; a scale is named after its weight plus
`_scale_inv`. `quantization="fp8"` quantizes a bf16/fp32 checkpoint (or dummy weights) at load into
the same layout (`Fp8Spec.online`), so one code path serves both.
"""

from __future__ import annotations

import torch
from torch import nn

from afdserve.kernels import ops
from afdserve.kernels.ops import FP8_DTYPE, quantize_blockwise, scale_grid
from afdserve.model.layers.moe import Experts
from afdserve.model.quantization import Fp8Spec

SCALE_SUFFIX = "_scale_inv"


class Fp8Linear(nn.Module):
    """A linear layer whose weight is block-scaled FP8: `weight` [out, in] float8_e4m3fn and
    `weight_scale_inv` [ceil(out / 128), ceil(in / 128)] float32 (the checkpoint's names), an
    optional bias in the model dtype."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        block: tuple[int, int],
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features, self.block = in_features, out_features, block
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=FP8_DTYPE, device=device),
            requires_grad=False,
        )
        grid = scale_grid(out_features, in_features, block)
        self.weight_scale_inv = nn.Parameter(
            torch.empty(grid, dtype=torch.float32, device=device), requires_grad=False
        )
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return ops.fp8_linear(x, self.weight, self.weight_scale_inv, self.bias, self.block)

    def dequantized(self, dtype: torch.dtype) -> torch.Tensor:
        return ops.dequantize_fp8(self.weight, self.weight_scale_inv, dtype, self.block)


def linear_weight(module: nn.Module, dtype: torch.dtype) -> torch.Tensor:
    """A linear layer's weight as a matrix in `dtype`, for code that uses it directly (MLA's
    absorbed attention folds kv_b_proj into the query)."""
    if isinstance(module, Fp8Linear):
        return module.dequantized(dtype)
    return module.weight


# Families whose checkpoints say `block_sparse_moe` for afdserve's `mlp` and w1/w3/w2 for the
# experts' gate/up/down projections.
BLOCK_SPARSE_MOE_FAMILIES = ("mixtral", "minimax_m2")


def _checkpoint_names(config_family: str, name: str) -> tuple[str, ...]:
    """afdserve's module name and, for Mixtral and MiniMax-M2, the checkpoint's."""
    if config_family in BLOCK_SPARSE_MOE_FAMILIES and ".mlp." in name:
        return name, name.replace(".mlp.", ".block_sparse_moe.")
    return (name,)


def _expert_modules(family: str, name: str, experts: int) -> list[tuple[str, ...]]:
    mixtral_names = family in BLOCK_SPARSE_MOE_FAMILIES
    projs = ("w1", "w3", "w2") if mixtral_names else ("gate_proj", "up_proj", "down_proj")
    return [_checkpoint_names(family, f"{name}.{e}.{p}") for e in range(experts) for p in projs]


def convert_to_fp8(model: nn.Module, family: str, num_experts: int, spec: Fp8Spec) -> None:
    """Turn the model's quantizable modules into FP8 ones, in place, before it has storage (on
    meta): every nn.Linear but lm_head, and every routed-expert stack, less modules_to_not_convert.
    The stacked experts of a layer are all FP8 or all not: a skip list that names only some of
    them is refused."""
    for parent_name, parent in list(model.named_modules()):
        for child_name, child in list(parent.named_children()):
            name = f"{parent_name}.{child_name}" if parent_name else child_name
            if isinstance(child, nn.Linear) and name != "lm_head":
                if spec.converts(*_checkpoint_names(family, name)):
                    fp8 = Fp8Linear(
                        child.in_features,
                        child.out_features,
                        child.bias is not None,
                        spec.block,
                        child.weight.device,
                    )
                    setattr(parent, child_name, fp8)
            elif isinstance(child, Experts):
                # A pattern may name the stack itself (transformers' own module tree) or the
                # checkpoint's experts one by one.
                wanted = {
                    spec.converts(*names) for names in _expert_modules(family, name, num_experts)
                }
                if not spec.converts(*_checkpoint_names(family, name)):
                    wanted = {False}
                if len(wanted) > 1:
                    raise ValueError(
                        f"quantization_config.modules_to_not_convert names some of {name}'s "
                        "routed experts but not all: afdserve stacks a layer's experts, all FP8 "
                        "or none"
                    )
                if wanted == {True}:
                    quantize_experts(child, spec.block)


def quantize_experts(experts: Experts, block: tuple[int, int]) -> None:
    """Replace an expert stack's weights by FP8 ones of the same shape plus their scale grids
    (see the module docstring for gate_up's two grids)."""
    for name in ("gate_up_proj", "down_proj"):
        old = getattr(experts, name)
        count, rows, cols = old.shape
        if name == "gate_up_proj":
            half = scale_grid(rows // 2, cols, block)
            grid = (2 * half[0], half[1])
        else:
            grid = scale_grid(rows, cols, block)
        setattr(
            experts,
            name,
            nn.Parameter(
                torch.empty(old.shape, dtype=FP8_DTYPE, device=old.device), requires_grad=False
            ),
        )
        setattr(
            experts,
            name + SCALE_SUFFIX,
            nn.Parameter(
                torch.empty(count, *grid, dtype=torch.float32, device=old.device),
                requires_grad=False,
            ),
        )
    experts.fp8_block = block


def is_fp8(tensor: torch.Tensor) -> bool:
    return tensor.dtype == FP8_DTYPE


def _is_float8(dtype: torch.dtype) -> bool:
    return str(dtype).startswith("torch.float8")


def quantize_weight(
    weight: torch.Tensor, stacked_gate_up: bool, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight -> (FP8 values, scale grid) in the model's layout: a stacked gate_up [..., 2I, H]
    gets a grid per half (see the module docstring)."""
    if not stacked_gate_up:
        return quantize_blockwise(weight, block)
    halves = [quantize_blockwise(h, block) for h in weight.chunk(2, dim=-2)]
    return (torch.cat([q for q, _ in halves], dim=-2), torch.cat([s for _, s in halves], dim=-2))


def load_problem(
    name: str, src: torch.Tensor, dst: torch.Tensor, spec: Fp8Spec | None
) -> str | None:
    """Why checkpoint tensor `name` cannot fill `dst`, as far as FP8 goes (None: it can). A
    copy would otherwise cast silently: FP8 values without their scales, a bf16 scale."""
    online = spec is not None and spec.online
    if name.endswith(SCALE_SUFFIX):
        if src.dtype != torch.float32:
            return (
                f"{name}: dtype {src.dtype} for a block scale; FP8 checkpoints store "
                "weight_scale_inv as float32"
            )
        return None
    if is_fp8(dst):
        if online and _is_float8(src.dtype):
            return (
                f"{name}: {src.dtype} in a checkpoint whose config.json has no "
                "quantization_config: FP8 weights cannot be read without their scales"
            )
        if not online and src.dtype != FP8_DTYPE:
            return (
                f"{name}: dtype {src.dtype} in an FP8 checkpoint, float8_e4m3fn expected "
                "(with its weight_scale_inv); a module kept in another dtype must be named "
                "in quantization_config.modules_to_not_convert"
            )
        return None
    if _is_float8(src.dtype):
        why = (
            "config.json has no quantization_config"
            if spec is None or online
            else "the module is never quantized (embeddings, norms, routers, lm_head) or is in "
            "quantization_config.modules_to_not_convert"
        )
        return (
            f"{name}: {src.dtype} in the checkpoint, but afdserve keeps this tensor in "
            f"{dst.dtype}: {why}; FP8 weights cannot be read without their scales"
        )
    return None


def scale_shape_error(
    name: str, got: tuple[int, ...], want: tuple[int, ...], fp4: bool = False
) -> str:
    if fp4:  # DeepSeek-V4's FP4 experts (kernels/reference/fp4.py)
        return (
            f"{name}: shape {got} in the checkpoint, expected {want}: one ue8m0 scale per "
            "32 inputs of each row of its weight (out x in / 32)"
        )
    return (
        f"{name}: shape {got} in the checkpoint, expected {want}: one scale per "
        "128x128 block of its weight, partial blocks included (ceil(out / 128) x "
        "ceil(in / 128))"
    )
