"""`afdserve bench decode` on a tiny gpt-oss checkpoint (CPU): colocated and in-process 1A1F run,
and the KV bytes a step reports are a count made by hand: a full layer reads every cached
position, a sliding layer its window only."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve.bench.decode import DecodeBench, run_decode_bench
from afdserve.model.fixtures.tiny import make_tiny_model

CONTEXT, STEPS, BATCH, BLOCK = 10, 3, 3, 4


@pytest.fixture(scope="module")
def gpt_oss_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gpt-oss-bench") / "m", "gpt_oss", seed=2)


@pytest.mark.parametrize("topology", ["colocated", "in-process"])
def test_decode_bench_counts_the_windows_by_hand(gpt_oss_dir: Path, topology: str) -> None:
    bench = DecodeBench(
        model_dir=str(gpt_oss_dir),
        batch_sizes=(1, BATCH),
        context_len=CONTEXT,
        steps=STEPS,
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
        topology=topology,
    )
    results, _ = run_decode_bench(bench)
    assert all(r.step_ms > 0 and r.weight_bytes > 0 for r in results)
    # Timed positions 13, 14, 15 (a step for the experts' count and 2 warm-ups first). Per
    # position p: the 2 full layers read p + 1 rows, the 2 sliding ones their window, 8; a row
    # is keys and values of 2 KV heads of 16 float32s.
    row = 2 * 2 * 16 * 4
    mean = sum(row * (2 * (p + 1) + 2 * 8) for p in (13, 14, 15)) / 3
    assert [r.kv_bytes for r in results] == [int(mean), int(BATCH * mean)]
