"""The fp8 A2E kernels (kernels/triton/a2e.py) on the GPU: bit for bit a2e.py's torch functions
(on CUDA and on CPU) in bf16, fp16 and float32, what a2e.py dispatches CUDA rows to, and captured
in a CUDA graph (no host sync, no allocation that depends on the data)."""

from __future__ import annotations

import pytest
import torch

from afdserve.kernels import a2e
from afdserve.kernels.a2e import A2EFormat

pytestmark = pytest.mark.gpu
triton_a2e = pytest.importorskip("afdserve.kernels.triton.a2e")  # needs Triton

DTYPES = [torch.bfloat16, torch.float16, torch.float32]
INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32}


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view(INT[t.element_size()])


def same(got: torch.Tensor, want: torch.Tensor) -> None:
    assert got.dtype == want.dtype and got.shape == want.shape, (got.shape, want.shape)
    assert torch.equal(bits(got).cpu(), bits(want).cpu()), (bits(got) != bits(want)).nonzero()[:5]


def rows_of(rows: int, hidden: int, dtype: torch.dtype, seed: int = 0):
    """(x [rows, hidden] on CUDA, route ids [rows] with pad rows): random rows with a zero row, a
    row of -0.0, outliers, tiny values (fp16 subnormals, float32 / bf16 scales below float32's
    normals) and scattered -0.0; a row stride wider than the row."""
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, hidden + 16, generator=gen)[:, :hidden] * 3
    if rows >= 7:
        x[1], x[2] = 0.0, -0.0
        x[3, ::37] = 3000.0
        x[4] *= 1e-6 if dtype == torch.float16 else 1e-38
        x[6, ::5] = -0.0
    ids = torch.randint(0, 1000, (rows,), generator=gen)
    ids[::3] = -1
    return x.to(dtype).cuda(), ids.cuda()


def oracle(x: torch.Tensor, dtype: torch.dtype, ids: torch.Tensor | None = None) -> torch.Tensor:
    if ids is not None:
        x = a2e.pad_zeroed(x, ids)
    return a2e.dequantize_rows_torch(*a2e.quantize_rows_torch(x), dtype)


@pytest.mark.parametrize("hidden", [64, 200, 2048, 2112])
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_equal_the_torch_path_bit_for_bit(dtype: torch.dtype, hidden: int) -> None:
    x, ids = rows_of(37, hidden, dtype)
    assert a2e._kernels(x, x.dtype) is triton_a2e  # what a2e.py runs for these rows
    q_want, s_want = a2e.quantize_rows_torch(x)
    q, s = triton_a2e.quantize_rows(x)
    same(q, q_want)
    same(s, s_want)
    q_cpu, s_cpu = a2e.quantize_rows_torch(x.cpu())  # the CPU's torch: the same bytes
    same(q, q_cpu)
    same(s, s_cpu)
    for out in DTYPES:
        same(triton_a2e.dequantize_rows(q_want, s_want, out), oracle(x, out))
        same(triton_a2e.roundtrip(x, out), oracle(x, out))
        same(triton_a2e.roundtrip(x, out, ids), oracle(x, out, ids))
        same(triton_a2e.roundtrip(x, out, ids.int()), oracle(x, out, ids))
    fp8 = A2EFormat("fp8", dtype)
    same(fp8.ffn_rows(x, ids), oracle(x, dtype, ids))
    same(fp8.roundtrip(x), oracle(x, dtype))
    same(fp8.decode(*fp8.encode(x)), oracle(x, dtype))


@pytest.mark.parametrize("dtype", DTYPES)
def test_no_rows(dtype: torch.dtype) -> None:
    x, ids = rows_of(0, 200, dtype)
    q, s = triton_a2e.quantize_rows(x)
    assert q.shape == (0, 200) and s.shape == (0, 2)
    assert triton_a2e.dequantize_rows(q, s, dtype).shape == (0, 200)
    assert triton_a2e.roundtrip(x, dtype, ids).shape == (0, 200)


def test_non_finite_rows() -> None:
    """inf and NaN: the scales bit for bit, NaN where torch's are, equal bytes elsewhere (NaN's
    bit pattern after a cast to bf16 / fp16 is the instruction's, not a format's)."""
    x = torch.randn(3, 200, generator=torch.Generator().manual_seed(2))
    x[0, 3], x[1, 130], x[2, 7] = float("nan"), float("inf"), -float("inf")
    for dtype in DTYPES:
        xd = x.to(dtype).cuda()
        q_want, s_want = a2e.quantize_rows_torch(xd)
        q, s = triton_a2e.quantize_rows(xd)
        same(s, s_want)
        nan = q_want.float().isnan()
        assert torch.equal(q.float().isnan(), nan)
        same(q.view(torch.uint8)[~nan], q_want.view(torch.uint8)[~nan])
        want, got = oracle(xd, dtype), triton_a2e.roundtrip(xd, dtype)
        assert torch.equal(got.isnan(), want.isnan())
        same(got[~want.isnan()], want[~want.isnan()])


@pytest.mark.parametrize("rows", [1, 33, 256])
@pytest.mark.parametrize("dtype", DTYPES)
def test_captured_in_a_cuda_graph(dtype: torch.dtype, rows: int) -> None:
    """Each path through a2e.py captured once, then replayed on other rows copied into the same
    buffers: what the torch path computes on those rows."""
    fp8 = A2EFormat("fp8", dtype)
    x, ids = rows_of(rows, 2048, dtype, seed=1)
    x = x.contiguous()

    def step() -> tuple[torch.Tensor, ...]:
        q, s = a2e.quantize_rows(x)
        return q, s, a2e.dequantize_rows(q, s, dtype), fp8.ffn_rows(x, ids), fp8.roundtrip(x)

    step()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        outs = step()
    new_x, new_ids = rows_of(rows, 2048, dtype, seed=2)
    x.copy_(new_x)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    q_want, s_want = a2e.quantize_rows_torch(new_x)
    wants = (
        q_want,
        s_want,
        oracle(new_x, dtype),
        oracle(new_x, dtype, new_ids),
        oracle(new_x, dtype),
    )
    for got, want in zip(outs, wants):
        same(got, want)
