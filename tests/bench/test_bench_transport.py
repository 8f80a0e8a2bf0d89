"""`afdserve bench transport` on CPU: the bytes per layer it reports for the model-dtype and the
fp8 A2E payload, and the fp8 layers' batches over a real gloo pair (the timing itself needs two
GPUs)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from afdserve.bench.transport import (
    TransportBench,
    format_transport_table,
    layer_bytes,
    nccl_fp8_layers,
)
from afdserve.frontend.process import free_port
from afdserve.kernels.a2e import A2EFormat


def test_layer_bytes_fp8_is_half_plus_the_scales():
    spec = TransportBench(hidden=2048, dtype="bfloat16")
    sizes = layer_bytes(spec, 64)
    assert sizes == {"a2e": 64 * 4096, "a2e_fp8": 64 * (2048 + 16 * 4), "e2a": 64 * 4096}
    table = format_transport_table(spec, [(n, t, 1.0) for n in spec.rows for t in spec.transports])
    assert "| 64 | 262144 | 135168 | 262144 |" in table


def _pair(rank: int, port: int, results) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    x = torch.randn(5, 300, generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    ids = torch.arange(9, dtype=torch.int32)
    out = torch.empty_like(x)
    nccl_fp8_layers(rank, 3, x, ids, out)
    if rank == 0:
        results.put(torch.equal(out, A2EFormat("fp8", torch.bfloat16).roundtrip(x)))
    dist.destroy_process_group()


def test_fp8_layers_reply_with_the_rows_the_ffn_read():
    results = mp.get_context("spawn").Queue()
    mp.start_processes(_pair, args=(free_port(), results), nprocs=2, start_method="spawn")
    assert results.get(timeout=10)
