"""The format of the rows the attention side hands to the FFN half (A2E), `AFDConfig.a2e_dtype`:

  auto      the model dtype: the rows travel as they are (today's wire, bit for bit)
  bfloat16  the rows travel as bfloat16 (a cast when the model runs in another dtype)
  fp8       each row is cut into groups of `GROUP` (128) channels; each group travels as
            float8_e4m3fn values `q` and one float32 scale, `x ~= q * scale`, scale = amax / 448

The FFN output coming back (E2A) stays in the model dtype: it is added to the residual stream.

Why a scale per 128 channels rather than one per row: a few channels of an LLM's hidden state
run far larger than the rest, and one scale per row sized for them leaves the other channels few
of e4m3's exponent steps; DeepSeek-V3 quantizes its activations in 1x128 tiles for that reason.
Per group costs 4 bytes per 128 channels (3%) where per row costs 4 bytes a row, and both are
local to the row, so a row's bytes never depend on which tile, pad rows or peers it travels with:
that is what keeps AFD token-identical to colocated, where the same round trip runs at the
boundary (engine/model_runner.py's LocalFFN). A last partial group scales the channels it holds.

A zero row (every pad row) has scale 0 and zero values; the FFN side checks pad rows' scales.

The `*_torch` functions are plain torch on the rows' own device and are the format's definition
(the oracle): about 15 small kernels per round trip. On CUDA with Triton installed, fp8 rows in
bf16 / fp16 / float32 take kernels/triton/a2e.py instead, bit for bit the same: one launch to
quantize, one to dequantize, and one for the round trip of a boundary with no wire (`roundtrip`,
`ffn_rows`), which never writes the fp8 rows. Both paths are CUDA-graph capturable; CPU rows
always take torch, and a world runs one path on both of its sides either way.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from afdserve.config import A2E_DTYPES
from afdserve.kernels.reference.fp8 import FP8_DTYPE, FP8_MAX, GROUP, scale_groups

__all__ = [
    "A2E_DTYPES",
    "GROUP",
    "A2EFormat",
    "dequantize_rows",
    "dequantize_rows_torch",
    "pad_zeroed",
    "quantize_rows",
    "quantize_rows_torch",
    "roundtrip_rows",
    "scale_groups",
]


def _grouped(x: torch.Tensor) -> torch.Tensor:
    """[rows, hidden] float32 -> [rows, groups, GROUP], the last group zero-padded (a zero never
    raises a group's amax)."""
    rows, hidden = x.shape
    groups = scale_groups(hidden)
    return F.pad(x, (0, groups * GROUP - hidden)).view(rows, groups, GROUP)


def quantize_rows_torch(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """quantize_rows in plain torch: the definition."""
    rows, hidden = x.shape
    grouped = _grouped(x.float())
    # A product with a constant rounds the same on every device; a division by a scalar is
    # a product with its reciprocal on some and a true division on others.
    scales = grouped.abs().amax(dim=-1) * (1.0 / FP8_MAX)
    # A zero group divides by 1 (its values are zeros either way) and keeps scale 0.
    divisor = torch.where(scales > 0, scales, torch.ones_like(scales)).unsqueeze(-1)
    # amax / (amax / 448) may round a hair above 448: clamp, as DeepSeek's act_quant does.
    q = (grouped / divisor).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    return q.view(rows, grouped.shape[1] * GROUP)[:, :hidden].contiguous(), scales


def dequantize_rows_torch(
    q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype
) -> torch.Tensor:
    """dequantize_rows in plain torch: the definition."""
    rows, hidden = q.shape
    x = _grouped(q.float()) * scales.unsqueeze(-1)
    return x.view(rows, x.shape[1] * GROUP)[:, :hidden].to(dtype).contiguous()


def pad_zeroed(x: torch.Tensor, route_ids: torch.Tensor) -> torch.Tensor:
    """x with its pad rows (token id -1) zeroed. The rows a graph pads a batch with are computed
    from a pad input and are not zeros; their output is never read, so zeroing them changes no
    real row, and lets the FFN side check that a pad row's fp8 scale is 0."""
    return x.masked_fill((route_ids < 0).unsqueeze(1), 0)


def _kernels(x: torch.Tensor, *dtypes: torch.dtype):
    """kernels/triton/a2e.py when x is on CUDA, Triton is installed and every dtype given (x's
    or the output's) is one the kernels read or write; else None (the torch path). Imported on
    first use: CPU-only installs have no Triton."""
    if not (x.is_cuda and x.dim() == 2):
        return None
    try:
        from afdserve.kernels.triton import a2e as triton_a2e
    except ImportError:
        return None
    return triton_a2e if all(d in triton_a2e.DTYPES for d in dtypes) else None


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [rows, hidden] -> (q float8_e4m3fn [rows, hidden], scales float32 [rows, groups])."""
    fast = _kernels(x, x.dtype)
    return fast.quantize_rows(x) if fast else quantize_rows_torch(x)


def dequantize_rows(q: torch.Tensor, scales: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q [rows, hidden], scales [rows, groups]) -> x [rows, hidden] in `dtype`."""
    fast = _kernels(q, dtype) if q.dtype == FP8_DTYPE else None
    if fast:
        return fast.dequantize_rows(q, scales, dtype)
    return dequantize_rows_torch(q, scales, dtype)


def roundtrip_rows(
    x: torch.Tensor, dtype: torch.dtype, route_ids: torch.Tensor | None = None
) -> torch.Tensor:
    """dequantize_rows(*quantize_rows(x), dtype), after pad_zeroed(x, route_ids) when given; on
    CUDA one launch that never writes the fp8 rows."""
    fast = _kernels(x, x.dtype, dtype)
    if fast:
        return fast.roundtrip(x, dtype, route_ids)
    if route_ids is not None:
        x = pad_zeroed(x, route_ids)
    return dequantize_rows_torch(*quantize_rows_torch(x), dtype)


@dataclass(frozen=True)
class A2EFormat:
    """The A2E format of one world: `name` (one of A2E_DTYPES) over the model's dtype."""

    name: str = "auto"
    model_dtype: torch.dtype = torch.float32

    def __post_init__(self) -> None:
        if self.name not in A2E_DTYPES:
            raise ValueError(f"a2e_dtype={self.name!r} is not allowed: one of {A2E_DTYPES}")

    @property
    def scaled(self) -> bool:
        return self.name == "fp8"

    @property
    def wire_dtype(self) -> torch.dtype:
        """The dtype of the hidden rows as they travel."""
        return {"fp8": FP8_DTYPE, "bfloat16": torch.bfloat16}.get(self.name, self.model_dtype)

    @property
    def plain(self) -> bool:
        """The rows travel as they are: every path stays exactly as without the option."""
        return self.wire_dtype == self.model_dtype

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [rows, hidden] -> (rows as they travel, float32 scales [rows, groups] or None)."""
        if self.scaled:
            return quantize_rows(x)
        return x.to(self.wire_dtype), None

    def decode(self, rows: torch.Tensor, scales: torch.Tensor | None) -> torch.Tensor:
        """What the FFN half reads, in the model dtype."""
        if self.scaled:
            return dequantize_rows(rows, scales, self.model_dtype)
        return rows.to(self.model_dtype)

    def roundtrip(self, x: torch.Tensor) -> torch.Tensor:
        """x as the FFN half sees it after the hand-over (x itself when the format is plain)."""
        if self.scaled:
            return roundtrip_rows(x, self.model_dtype)
        return x if self.plain else self.decode(*self.encode(x))

    def ffn_rows(self, x: torch.Tensor, route_ids: torch.Tensor) -> torch.Tensor:
        """What an FFN rank decodes from a tile of x (pad rows zeroed first): what a boundary
        with no wire (colocated, in process) hands its FFN half. x itself when plain."""
        if self.scaled:
            return roundtrip_rows(x, self.model_dtype, route_ids)
        return x if self.plain else self.roundtrip(pad_zeroed(x, route_ids))

    def row_bytes(self, hidden: int) -> int:
        """Bytes one hidden row takes on the wire, scales included (ids and routing apart)."""
        scales = 4 * scale_groups(hidden) if self.scaled else 0
        return hidden * self.wire_dtype.itemsize + scales
