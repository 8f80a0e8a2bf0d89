"""`afdserve bench decode` on a Gated DeltaNet hybrid (CPU): the bench gives each sequence a
state slot, decode steps run the batched step, and the bytes it counts are the full layers' KV
of the context plus each linear layer's slot read and written."""

from __future__ import annotations

import pytest
import torch

from afdserve.bench.decode import DecodeBench, run_decode_bench
from afdserve.model.families import cache_layout, load_model_config
from afdserve.model.fixtures.tiny import make_tiny_model


@pytest.mark.parametrize("topology,ubatches", [("colocated", 1), ("in-process", 2)])
def test_decode_bench_runs_a_hybrid_on_cpu(tmp_path, topology, ubatches):
    model = make_tiny_model(tmp_path / "next", "qwen3_next", seed=1)
    spec = DecodeBench(
        model_dir=str(model),
        random_weights=True,
        batch_sizes=(1, 3),
        context_len=20,
        steps=3,
        dtype="float32",
        device="cpu",
        topology=topology,
        ubatches=ubatches,
    )
    results, _ = run_decode_bench(spec)
    assert [r.batch for r in results] == [1, 3]
    assert all(r.step_ms > 0 and r.tokens_per_s > 0 for r in results)
    layout = cache_layout(load_model_config(model))
    mean_context = 20 + 3 + (3 + 1) / 2  # warm-up steps, then the timed steps
    one = mean_context * layout.bytes_per_block(1, torch.float32)
    one += 2 * layout.bytes_per_slot(torch.float32)
    assert [r.kv_bytes for r in results] == [int(one), int(3 * one)]
