"""The IPC data plane's push kernel against what it must write: rows, zero pad rows, and the id
payload (header, ids, -1 on pad rows); garbage in the destination must not survive."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    ("rows", "tile", "width"),
    [(1, 1, 64), (3, 8, 2048), (64, 64, 2048), (5, 7, 100), (0, 4, 32), (250, 256, 7168)],
)
def test_push_tile_writes_rows_pads_and_ids(dtype, rows, tile, width):
    from afdserve.kernels.triton.push import push_tile

    dev = torch.device("cuda")
    gen = torch.Generator(device=dev).manual_seed(rows * 31 + tile)
    src = torch.randn(rows, width, device=dev, generator=gen).to(dtype)
    dst = torch.full((tile, width), float("nan"), device=dev, dtype=dtype)  # garbage
    ids = torch.randint(0, 1000, (rows,), device=dev, generator=gen)
    ids_dst = torch.full((4 + tile,), -7, dtype=torch.int32, device=dev)
    step = torch.tensor([123456], dtype=torch.int32, device=dev)
    push_tile(src, dst, ids, ids_dst, step, layer=5, ubatch=2, header=4)
    want = torch.zeros(tile, width, device=dev, dtype=dtype)
    want[:rows] = src
    assert torch.equal(dst, want)
    want_ids = torch.full((4 + tile,), -1, dtype=torch.int32, device=dev)
    want_ids[:4] = torch.tensor([123456, 5, 2, tile], dtype=torch.int32)
    want_ids[4 : 4 + rows] = ids.to(torch.int32)
    assert torch.equal(ids_dst, want_ids)


def test_push_tile_without_ids_and_into_a_strided_row_block():
    from afdserve.kernels.triton.push import push_tile

    dev = torch.device("cuda")
    src = torch.randn(6, 48, device=dev)
    big = torch.full((10, 48), 9.0, device=dev)
    push_tile(src[2:5], big[4:8])  # rows 4..7 of a larger buffer; 3 real rows, 1 pad row
    assert torch.equal(big[4:7], src[2:5])
    assert torch.equal(big[7], torch.zeros(48, device=dev))
    assert torch.equal(big[:4], torch.full((4, 48), 9.0, device=dev))
    assert torch.equal(big[8:], torch.full((2, 48), 9.0, device=dev))


def test_push_tile_rejects_rows_beyond_the_tile():
    from afdserve.kernels.triton.push import push_tile

    dev = torch.device("cuda")
    with pytest.raises(ValueError, match="do not fit"):
        push_tile(torch.zeros(5, 8, device=dev), torch.zeros(4, 8, device=dev))
