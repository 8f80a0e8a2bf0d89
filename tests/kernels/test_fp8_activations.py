"""The w8a8 oracle's activation quantization (kernels/fp8.quantize_activations), against
torch's own float8_e4m3fn rounding: power-of-two scales per 128-group, every group's largest
value in (224, 448] before rounding, zeros kept, a partial last group scaled on its own."""

from __future__ import annotations

import torch

from afdserve.kernels.reference import fp8


def test_groups_take_power_of_two_scales_and_round_as_torch_does():
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 300, generator=gen) * torch.logspace(-6, 6, 300)[None, :]
    x[2, 128:256] = 0.0
    got = fp8.quantize_activations(x, 128)
    assert got.shape == x.shape and got.dtype == torch.float32
    for row in range(5):
        for lo in range(0, 300, 128):
            group = x[row, lo : lo + 128].float()
            amax = group.abs().max()
            if amax == 0:
                assert torch.equal(got[row, lo : lo + 128], group)
                continue
            exponent = torch.ceil(torch.log2(amax / 448.0))
            scale = 2.0**exponent
            assert 224.0 < float(amax / scale) <= 448.0
            want = (group / scale).to(torch.float8_e4m3fn).float() * scale
            assert torch.equal(got[row, lo : lo + 128], want)


def test_quantization_error_is_at_most_half_an_e4m3_step():
    x = torch.randn(64, 256, generator=torch.Generator().manual_seed(1))
    got = fp8.quantize_activations(x)
    # e4m3 keeps 3 mantissa bits: relative error of a normal value at most 2^-4.
    big = x.abs() > x.abs().amax() * 2.0**-6
    assert ((got - x).abs()[big] <= x.abs()[big] * 2.0**-4 + 1e-12).all()
    assert not torch.equal(got, x)


def test_w8a8_linear_is_the_quantized_rows_against_the_dequantized_weight():
    gen = torch.Generator().manual_seed(2)
    w = torch.randn(96, 200, generator=gen) * 0.1
    q, scale = fp8.quantize_blockwise(w, (128, 128))
    x, bias = torch.randn(3, 200, generator=gen), torch.randn(96, generator=gen)
    got = fp8.fp8_linear_w8a8(x, q, scale, bias, (128, 128))
    w_deq = fp8.dequantize_blockwise(q, scale, torch.float32, (128, 128))
    want = fp8.quantize_activations(x) @ w_deq.T + bias
    torch.testing.assert_close(got, want)
    assert (got - fp8.fp8_linear(x, q, scale, bias, (128, 128))).abs().max() > 0
