"""FP4 (e2m1) weights with ue8m0 scales, DeepSeek-V4's routed-expert format: the plain-torch
reference.

A weight [..., out, in] is stored as two e2m1 values per byte, [..., out, in / 2], element 2j in
the low nibble and 2j + 1 in the high one (as transformers' Fp8Dequantize unpacks them), and one
ue8m0 scale per 32 consecutive inputs of a row, [..., out, in / 32]: a byte b meaning 2^(b - 127)
(torch.float8_e8m0fnu's encoding). An e2m1 nibble is sign (bit 3), exponent (bits 2-1, bias 1)
and mantissa (bit 0): the values 0, 0.5, 1, 1.5, 2, 3, 4, 6 and their negatives.

In memory afdserve keeps both as uint8 (`packed`, `scale`): a shift of uint8 is logical, and
float8_e8m0fnu has no arithmetic on CUDA. The reference is weight-only, like
kernels/reference/fp8.py: activations stay in the model dtype, each routed expert is dequantized
right before its matmuls.
"""

from __future__ import annotations

import torch

from afdserve.kernels.reference.layers import ExpertGLU, routed_experts

FP4_BLOCK = 32  # inputs per ue8m0 scale
E8M0_BIAS = 127
# The magnitudes of the eight e2m1 codes 0..7 (code | 8 is the same magnitude, negative).
E2M1_MAGNITUDES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E2M1_MAX = 6.0
ONE_BYTE = (torch.uint8, torch.int8, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)
# The largest scale byte the CUDA kernels take (kernels/moe/fp4_decode.py, `SCALE_BYTES`): 2^17,
# weights up to 6 x 2^17. Real groups sit far below (DeepSeek-V4 and gpt-oss: about 2^-7 to 2^0);
# a checkpoint with a larger one is refused when it loads (`scale_problem`).
MAX_SCALE_BYTE = E8M0_BIAS + 17


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A one-byte tensor (int8, uint8, float8_e8m0fnu, float4_e2m1fn_x2) viewed as uint8."""
    if t.dtype not in ONE_BYTE:
        raise ValueError(f"dtype {t.dtype}: expected a one-byte dtype, one of {ONE_BYTE}")
    return t if t.dtype == torch.uint8 else t.view(torch.uint8)


def scale_problem(name: str, scale: torch.Tensor) -> str | None:
    """Why checkpoint scale tensor `name` (ue8m0 bytes) cannot be loaded (None: it can)."""
    top = int(as_bytes(scale).max()) if scale.numel() else 0
    if top <= MAX_SCALE_BYTE:
        return None
    return (
        f"{name}: an FP4 group scale of 2^{top - E8M0_BIAS} (ue8m0 byte {top}); afdserve's FP4 "
        f"kernels take scales up to 2^{MAX_SCALE_BYTE - E8M0_BIAS} (byte {MAX_SCALE_BYTE})"
    )


def e8m0_to_float(scale: torch.Tensor) -> torch.Tensor:
    """ue8m0 scales (uint8 bits or float8_e8m0fnu) -> float32 2^(b - 127), exact."""
    return torch.exp2(as_bytes(scale).float() - E8M0_BIAS)


def float_to_e8m0(scale: torch.Tensor) -> torch.Tensor:
    """Positive float32 powers of two -> their ue8m0 bits (uint8)."""
    exponent = torch.log2(scale.float()).round().to(torch.int32) + E8M0_BIAS
    return exponent.clamp(0, 254).to(torch.uint8)


def unpack_e2m1(packed: torch.Tensor) -> torch.Tensor:
    """[..., n / 2] packed e2m1 -> float32 [..., n] (low nibble first). Computed from the codes'
    bits on their own device (no table copied there), so a CUDA graph can capture it."""
    b = as_bytes(packed)
    codes = torch.stack((b & 0xF, b >> 4), dim=-1).to(torch.int32).flatten(-2)
    exponent = (codes >> 1) & 3
    mantissa = (codes & 1).float()
    normal = torch.exp2((exponent - 1).float()) * (1.0 + 0.5 * mantissa)
    magnitude = torch.where(exponent == 0, 0.5 * mantissa, normal)  # code 1: the subnormal 0.5
    return torch.where((codes & 8) != 0, -magnitude, magnitude)


def dequantize_fp4(packed: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """packed [..., out, in / 2] and scale [..., out, in / 32] -> the weight [..., out, in] in
    `dtype` (the product in float32, rounded once, as transformers does)."""
    values = unpack_e2m1(packed)
    full = e8m0_to_float(scale).repeat_interleave(FP4_BLOCK, dim=-1)
    return (values * full).to(dtype)


@torch.no_grad()
def quantize_fp4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [..., out, in] (in a multiple of 32) -> (packed uint8 [..., out, in / 2], ue8m0
    scale uint8 [..., out, in / 32]). Each group's scale is the power of two at or above
    amax / 6, so that no value clips; each value rounds to the nearest e2m1 magnitude (a tie to
    the smaller). An all-zero group gets scale 1. What checkpoints hold and how a tiny test
    checkpoint is written; the loader never quantizes to FP4."""
    rows, cols = weight.shape[-2:]
    if cols % FP4_BLOCK:
        raise ValueError(f"quantize_fp4: {cols} inputs, not a multiple of {FP4_BLOCK}")
    w = weight.float().unflatten(-1, (cols // FP4_BLOCK, FP4_BLOCK))  # [..., out, groups, 32]
    amax = w.abs().amax(dim=-1)
    scale = torch.where(
        amax > 0, torch.exp2(torch.ceil(torch.log2(amax / E2M1_MAX))), torch.ones_like(amax)
    )
    scaled = (w / scale.unsqueeze(-1)).flatten(-2)  # [..., out, in], |.| <= 6
    # The magnitude's code: how many midpoints between neighbouring magnitudes lie below it
    # (at a midpoint, the smaller).
    mids = torch.tensor(E2M1_MAGNITUDES, device=weight.device)
    code = torch.bucketize(scaled.abs(), (mids[1:] + mids[:-1]) / 2)
    code = code | ((scaled < 0) & (code > 0)).long() << 3
    pairs = code.unflatten(-1, (cols // 2, 2))
    packed = (pairs[..., 0] | pairs[..., 1] << 4).to(torch.uint8)
    return packed, float_to_e8m0(scale)


def moe_experts_fp4(
    x: torch.Tensor,
    topk_ids: torch.Tensor,
    topk_weights: torch.Tensor,
    gate_up: tuple[torch.Tensor, torch.Tensor],
    down: tuple[torch.Tensor, torch.Tensor],
    limit: float | None = None,
    glu: ExpertGLU | None = None,
) -> torch.Tensor:
    """`reference.moe_experts` over FP4 experts: (packed, scale) of gate_up [E, 2I, H / 2] and
    down [E, H, I / 2]. Only the experts some row is routed to are dequantized, one at a time."""

    def weights_of(expert: int) -> tuple[torch.Tensor, torch.Tensor]:
        return (
            dequantize_fp4(gate_up[0][expert], gate_up[1][expert], x.dtype),
            dequantize_fp4(down[0][expert], down[1][expert], x.dtype),
        )

    num_experts = gate_up[0].shape[0]
    return routed_experts(x, topk_ids, topk_weights, num_experts, weights_of, limit, glu=glu)
