"""The format of the rows the attention side hands to the FFN half (A2E), `AFDConfig.a2e_dtype`:

  auto      the model dtype: the rows travel as they are (today's wire, bit for bit)
  bfloat16  the rows travel as bfloat16 (a cast when the model runs in another dtype)
  fp8       each row cut into groups of `GROUP` (128) channels (a last partial group scales what
            it holds), each float8_e4m3fn values `q` and a float32 scale = amax / 448

The FFN output coming back (E2A) stays in the model dtype. A scale per 128 channels, not per row:
a few channels of an LLM's hidden state run far larger than the rest (DeepSeek-V3 quantizes its
activations in 1x128 tiles for that reason); and local to the row, so its bytes never depend on
its tile, pad rows or peers, which keeps AFD token-identical to colocated (engine/model_runner.py's
LocalFFN runs the same round trip). A zero row (every pad row) has scale 0 and zero values.
The `*_torch` functions are the format's definition (the oracle); on CUDA with Triton, fp8 rows
take kernels/triton/a2e.py, bit for bit the same (a launch per quantize, dequantize or wire-less
round trip); both are CUDA-graph capturable, and a world runs one path on both of its sides.
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
