"""What a ubatch builds once for its layers, on CUDA: the rows (`step_rows.step_rows`), their
window addresses (`step_rows.window_rows`) and rotary tables (`rotary.cos_sin`) against the torch
forms they replace (`rows._rows_torch`, `LayerPages.batch_rows`' arithmetic, `RopeTable.at`'s),
eager and replayed from a CUDA graph on new segments."""

from __future__ import annotations

import pytest
import torch

from afdserve.kernels.metadata import BatchedSegments
from afdserve.model.families.deepseek_v4.rows import _rows_torch
from tests.gpu.test_v4_fused import triton_module

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]
DEVICE = "cuda"


def segments(counts: list[int], width: int, seed: int) -> BatchedSegments:
    gen = torch.Generator().manual_seed(seed)
    starts = torch.tensor([0, *counts]).cumsum(0).to(torch.int32)
    context = torch.randint(1, 9000, (len(counts),), generator=gen).to(torch.int32)
    tables = torch.randint(0, 10**6, (len(counts), width), generator=gen).to(torch.int32)
    slots = torch.randperm(len(counts) + 3, generator=gen)[: len(counts)].to(torch.int32)
    return BatchedSegments(
        starts.to(DEVICE), context.to(DEVICE), tables.to(DEVICE), max(counts), 9000,
        state_slots=slots.to(DEVICE),
    )  # fmt: skip


def assert_rows_equal(got, want) -> None:
    for name, g, w in zip(("tables", "real", "start", "end", "slots", "window"), got, want):
        assert (g is None) == (w is None), name
        if g is not None:
            assert g.dtype == w.dtype and torch.equal(g, w), name


@pytest.mark.parametrize("counts, pad", [([1] * 64, 0), ([1] * 7, 1), ([3, 1, 200, 1], 5)])
def test_step_rows_equal_the_torch_form(counts, pad):
    k = triton_module("step_rows")
    batched = segments(counts, 160, seed=len(counts))
    window = torch.randint(0, 500, (len(counts), 9), device=DEVICE, dtype=torch.int32)
    rows = sum(counts) + pad
    for wtables in (None, window):
        args = (batched.query_start, batched.context_lens, batched.block_tables, rows)
        got = k.step_rows(*args, batched.state_slots, wtables)
        assert_rows_equal(got, _rows_torch(batched, rows, batched.state_slots, wtables))


def test_step_rows_replay_from_a_graph_on_new_segments():
    """A decode graph's rows: captured over one step's segments, replayed over the next's."""
    k = triton_module("step_rows")
    batched = segments([1] * 8, 32, seed=1)
    args = (batched.query_start, batched.context_lens, batched.block_tables, 10)
    k.step_rows(*args, batched.state_slots, None)  # compiled before the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        got = k.step_rows(*args, batched.state_slots, None)
    new = segments([1] * 8, 32, seed=2)
    batched.context_lens.copy_(new.context_lens)
    batched.block_tables.copy_(new.block_tables)
    batched.state_slots.copy_(new.state_slots)
    graph.replay()
    torch.cuda.synchronize()
    assert_rows_equal(got, _rows_torch(new, 10, new.state_slots, None))


def test_window_rows_equal_the_torch_arithmetic():
    k = triton_module("step_rows")
    gen = torch.Generator().manual_seed(3)
    rows, width, window, block = 64, 40, 128, 64
    tables = torch.randint(0, 5000, (rows, width), generator=gen).to(DEVICE)
    positions = torch.randint(0, width * block + 100, (rows,), generator=gen).to(DEVICE)
    positions[:3] = torch.tensor([0, 5, 127])
    q = (positions[:, None] - torch.arange(window, device=DEVICE)).clamp(0, width * block - 1)
    want = tables.gather(1, q // block) * block + q % block
    assert torch.equal(k.window_rows(positions, tables, window, block, block), want)


def test_cos_sin_equal_rope_table_at():
    """torch's CUDA cos/sin and the kernel's libdevice ones, positions to past 2**20."""
    rotary = triton_module("rotary")
    inv_freq = (1.0 / (10000 ** (torch.arange(0, 64, 2) / 64))).float().to(DEVICE)
    positions = torch.cat([torch.arange(300), torch.randint(0, 2**21, (300,))]).to(DEVICE)
    freqs = positions.float()[:, None] * inv_freq[None, :]  # RopeTable.at's torch form
    torch_form = (freqs.cos() * 0.75, freqs.sin() * 0.75)
    for got, want in zip(rotary.cos_sin(positions, inv_freq, 0.75), torch_form):
        torch.testing.assert_close(got, want, rtol=0, atol=2e-7)
