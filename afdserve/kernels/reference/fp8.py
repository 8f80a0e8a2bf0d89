"""Block-scaled FP8 weights (DeepSeek-V3's format): the plain-torch reference.

A weight [..., out, in] is cut into blocks of `block = (block_out, block_in)` elements (128 x 128
in every published checkpoint, the only size afdserve reads); each block stores float8_e4m3fn
values `q` and one float32 `scale_inv` with `w ~= q * scale_inv`, so the scale grid is
[..., ceil(out / 128), ceil(in / 128)]. The last block of a dimension that is not a multiple of
the block is partial (DeepSeek-V3's kv_a_proj_with_mqa has 576 rows: 4.5 blocks, a grid of 5):
its scale covers only the rows that exist, as in DeepSeek's `weight_dequant` and vLLM's block
quantization (both pad to whole blocks and crop).

The reference is weight-only: activations stay in the model dtype and each weight is
dequantized right before its matmul (only the experts a step routes to, for the MoE). GPU
kernels that read FP8 directly plug in through `ops`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
import torch.nn.functional as F

from afdserve.kernels.reference.layers import routed_experts

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# Channels per float32 scale of an FP8 activation row (the A2E rows of kernels/a2e.py,
# which its Triton kernels share from here rather than from a2e.py, which dispatches to them).
GROUP = 128


class Fp8Rows(NamedTuple):
    """Activation rows already quantized for a w8a8 GEMM, by the kernel that produced them (the
    norm before a projection): e4m3 `values` [rows, K] and a float32 power-of-two scale per row
    and group of `GROUP` [rows, ceil(K / GROUP)], as triton_fp8_w8a8.quantize_rows writes them;
    `dtype`: the rows' dtype before, the GEMM's output dtype."""

    values: torch.Tensor
    scales: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.values.shape


def scale_groups(hidden: int) -> int:
    """Scales per row: one per `GROUP` channels, a last partial group included."""
    return -(-hidden // GROUP)


def scale_grid(rows: int, cols: int, block: tuple[int, int]) -> tuple[int, int]:
    """The scale grid of a [rows, cols] weight: one scale per block, partial blocks included."""
    return -(-rows // block[0]), -(-cols // block[1])


def _expand(scale_inv: torch.Tensor, rows: int, cols: int, block: tuple[int, int]) -> torch.Tensor:
    """[..., grid_rows, grid_cols] -> [..., rows, cols]: every element gets its block's scale."""
    full = scale_inv.repeat_interleave(block[0], dim=-2).repeat_interleave(block[1], dim=-1)
    return full[..., :rows, :cols]


@torch.no_grad()
def quantize_blockwise(
    weight: torch.Tensor, block: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] -> (q float8_e4m3fn [..., out, in], scale_inv float32 [..., grid]).

    Each block's largest |w| maps to 448 (vLLM's per_block_cast_to_fp8: q = w * (448 / amax),
    scale_inv = amax / 448); an all-zero block gets scale 1, so that its zeros stay zeros."""
    rows, cols = weight.shape[-2:]
    grid = scale_grid(rows, cols, block)
    w = weight.float()
    pad = (0, grid[1] * block[1] - cols, 0, grid[0] * block[0] - rows)
    padded = F.pad(w, pad)  # zeros never raise a block's amax
    lead = padded.shape[:-2]
    tiles = padded.reshape(*lead, grid[0], block[0], grid[1], block[1])
    amax = tiles.abs().amax(dim=(-3, -1))  # [..., grid_rows, grid_cols]
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    factor = _expand(FP8_MAX / torch.where(amax > 0, amax, FP8_MAX), rows, cols, block)
    q = (w * factor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q, scale_inv.contiguous()


def dequantize_blockwise(
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    dtype: torch.dtype,
    block: tuple[int, int],
) -> torch.Tensor:
    """q [..., out, in] (float8) and its scale grid -> the weight in `dtype` (the product is taken
    in float32, as transformers' Fp8Dequantize does, then rounded once)."""
    rows, cols = q.shape[-2:]
    return (q.float() * _expand(scale_inv.float(), rows, cols, block)).to(dtype)


def fp8_linear(
    x: torch.Tensor,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """y = x @ dequant(q)^T + bias, weight-only: x and y stay in x's dtype."""
    return F.linear(x, dequantize_blockwise(q, scale_inv, x.dtype, block), bias)


def quantize_activations(x: torch.Tensor, group: int = 128) -> torch.Tensor:
    """x [..., K] quantized to float8_e4m3fn in groups of `group` consecutive values of a row,
    each group with a power-of-two scale that brings its largest |value| into (224, 448], and
    returned dequantized (float32): what the w8a8 GPU kernels multiply (triton_fp8.as_operand's
    A_FP8). A power-of-two scale makes x / scale exact, so only the rounding to e4m3 differs."""
    k = x.shape[-1]
    pad = -k % group
    xf = F.pad(x.float(), (0, pad)).reshape(*x.shape[:-1], -1, group)
    amax = xf.abs().amax(dim=-1, keepdim=True).clamp_min(1e-30)
    scale = torch.exp2(torch.ceil(torch.log2(amax / FP8_MAX)))
    # The least power of two with amax / scale <= 448, checked exactly both ways (log2 rounds).
    scale = torch.where(amax / (scale / 2) <= FP8_MAX, scale / 2, scale)
    scale = torch.where(amax / scale > FP8_MAX, scale * 2, scale)
    q = (xf / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return (q.float() * scale).reshape(*x.shape[:-1], -1)[..., :k]


def fp8_linear_w8a8(
    x: torch.Tensor,
    q: torch.Tensor,
    scale_inv: torch.Tensor,
    bias: torch.Tensor | None,
    block: tuple[int, int],
) -> torch.Tensor:
    """y = quantize_activations(x) @ dequant(q)^T + bias in float32, rounded once to x's dtype:
    the oracle of the w8a8 GPU GEMM (DeepSeek's recipe), whose only other difference is the
    float32 summation order."""
    w = dequantize_blockwise(q, scale_inv, torch.float32, block)
    y = F.linear(quantize_activations(x, block[1]), w, None if bias is None else bias.float())
    return y.to(x.dtype)


def dequantize_gate_up(
    q: torch.Tensor, scale_inv: torch.Tensor, dtype: torch.dtype, block: tuple[int, int]
) -> torch.Tensor:
    """A stacked [..., 2I, H] gate/up weight whose halves are two matrices with a grid each
    (scale_inv [..., 2 * ceil(I / 128), ...]): when I is not a multiple of 128 the halves do not
    meet on a block boundary, so each half is dequantized on its own grid."""
    q_gate, q_up = q.chunk(2, dim=-2)
    s_gate, s_up = scale_inv.chunk(2, dim=-2)
    return torch.cat(
        (
            dequantize_blockwise(q_gate, s_gate, dtype, block),
            dequantize_blockwise(q_up, s_up, dtype, block),
        ),
        dim=-2,
    )


def moe_experts_fp8(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    block: tuple[int, int],
    limit: float | None = None,
    a8: bool = False,
) -> torch.Tensor:
    """`reference.moe_experts` over FP8 experts: (q, scale_inv) of gate_up [E, 2I, H] and down
    [E, H, I]. Only the experts some row is routed to are dequantized, one at a time, so the
    transient is one expert's weights in x's dtype. `a8`: x and the intermediate quantized per
    row in groups of 128 as well (the w8a8 GPU kernels' oracle; give float32 x)."""

    def weights_of(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_gate_up(gate_up[0][expert], gate_up[1][expert], x.dtype, block),
            dequantize_blockwise(down[0][expert], down[1][expert], x.dtype, block),
        )

    operand = (lambda t: quantize_activations(t, block[1]).to(t.dtype)) if a8 else None
    return routed_experts(
        x, topk_ids, topk_weights, gate_up[0].shape[0], weights_of, limit, operand
    )
