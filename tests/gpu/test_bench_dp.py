"""`afdserve bench decode -dp 2` on two GPUs: one replica process per GPU (each model on its own
cuda:i), timed at once, each decoding the batches one colocated process decodes on cuda:0 (the
same bytes per step), the aggregate the sum of the two."""

from __future__ import annotations

import pytest
import torch

from afdserve.bench.decode import DecodeBench, run_decode_bench
from afdserve.bench.decode_dp import format_dp_table, run_dp_decode_bench

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two CUDA devices"),
]


def spec(**overrides) -> DecodeBench:
    fields = dict(
        model_dir=None,
        preset="tiny",
        random_weights=True,
        batch_sizes=(1, 8),
        context_len=64,
        steps=10,
        dtype="bfloat16",
        device="cuda",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


@pytest.mark.parametrize("graph_mode", ["none", "full_decode_only"])
def test_two_replicas_on_two_gpus(graph_mode: str) -> None:
    two = run_dp_decode_bench(spec(graph_mode=graph_mode, data_parallel_size=2), 2)
    alone, _ = run_decode_bench(spec(graph_mode=graph_mode))
    print(format_dp_table(two, "cuda"))
    for row, one in zip(two, alone):
        assert row.devices == ("cuda:0", "cuda:1")
        for replica in row.replicas:
            assert (replica.batch, replica.weight_bytes, replica.kv_bytes) == (
                one.batch,
                one.weight_bytes,
                one.kv_bytes,
            )
            assert replica.step_ms > 0 and replica.copy_gbps and replica.copy_gbps > 0
        assert row.tokens_per_s == pytest.approx(sum(r.tokens_per_s for r in row.replicas))
        assert row.tokens_per_s_per_device == pytest.approx(row.tokens_per_s / 2)
