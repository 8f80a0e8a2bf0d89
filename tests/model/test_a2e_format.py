"""The A2E formats (kernels/a2e.py): fp8 rows with a float32 scale per 128 channels,
checked against a plain float64 oracle, and the bytes a row takes on the wire."""

from __future__ import annotations

import pytest
import torch

from afdserve.kernels.a2e import (
    GROUP,
    A2EFormat,
    dequantize_rows,
    quantize_rows,
    scale_groups,
)
from afdserve.kernels.reference.fp8 import FP8_DTYPE


def _rows(rows: int, hidden: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden, generator=g)
    x[:, 3] = 100.0  # an outlier channel, as LLM hidden states have
    return x


@pytest.mark.parametrize("hidden", [64, 128, 300, 2048])
def test_quantize_matches_a_float64_oracle(hidden):
    x = _rows(5, hidden)
    q, scales = quantize_rows(x)
    assert q.dtype == FP8_DTYPE and q.shape == x.shape
    assert scales.dtype == torch.float32 and scales.shape == (5, scale_groups(hidden))
    for g in range(scale_groups(hidden)):
        block = x[:, g * GROUP : (g + 1) * GROUP].double()
        amax = block.abs().amax(dim=1)
        torch.testing.assert_close(scales[:, g].double(), amax / 448, rtol=1e-6, atol=0)
    back = dequantize_rows(q, scales, torch.float32)
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 of the value, and values below the
    # smallest normal (2^-6 of the scale) lose up to 2^-10 of the group's scale.
    err = (back - x).abs()
    per_group = scales.repeat_interleave(GROUP, dim=1)[:, :hidden]
    assert bool((err <= x.abs() / 16 + per_group * 2**-9 + 1e-30).all())


def test_groups_keep_an_outlier_from_the_other_groups():
    """The outlier sits in group 0; every other group keeps its own, smaller scale."""
    x = _rows(3, 512)
    _, scales = quantize_rows(x)
    assert bool((scales[:, 0] > 5 * scales[:, 1:].max(dim=1).values).all())


def test_zero_rows_have_scale_zero_and_rows_are_independent():
    x = _rows(6, 300)
    x[2] = 0
    q, scales = quantize_rows(x)
    assert bool((scales[2] == 0).all()) and bool((q[2].float() == 0).all())
    # A row's bytes depend on that row alone: the tile it travels in does not matter.
    q1, s1 = quantize_rows(x[4:5])
    assert torch.equal(q1.view(torch.uint8), q[4:5].view(torch.uint8))
    assert torch.equal(s1, scales[4:5])
    assert dequantize_rows(q[:0], scales[:0], torch.float32).shape == (0, 300)


def test_formats():
    x = _rows(4, 64)
    auto = A2EFormat("auto", torch.float32)
    assert auto.plain and auto.roundtrip(x) is x and auto.row_bytes(64) == 256
    bf16 = A2EFormat("bfloat16", torch.bfloat16)
    assert bf16.plain  # a bfloat16 model's rows travel as they are
    cast = A2EFormat("bfloat16", torch.float32)
    assert not cast.plain and torch.equal(cast.roundtrip(x), x.to(torch.bfloat16).float())
    fp8 = A2EFormat("fp8", torch.bfloat16)
    assert fp8.scaled and fp8.wire_dtype == FP8_DTYPE and fp8.roundtrip(x).dtype == torch.bfloat16
    with pytest.raises(ValueError, match="a2e_dtype='fp4' is not allowed"):
        A2EFormat("fp4", torch.float32)


@pytest.mark.parametrize("hidden", [2048, 4096, 7168])
def test_fp8_bytes_per_row_are_half_bf16_plus_the_scales(hidden):
    """2048: 2048 B of values + 16 scales x 4 B = 2112 B against 4096 B of bf16: 0.5 + 2/128."""
    bf16 = A2EFormat("auto", torch.bfloat16).row_bytes(hidden)
    fp8 = A2EFormat("fp8", torch.bfloat16).row_bytes(hidden)
    assert bf16 == 2 * hidden
    assert fp8 == hidden + 4 * (hidden // GROUP)
    assert fp8 / bf16 == 0.515625
