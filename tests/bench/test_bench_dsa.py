"""`afdserve bench decode` on a tiny GLM-5 (DSA, shared indexer layers): it runs on CPU and
counts the KV bytes a decode step reads by hand: per full layer the selected latents and every
indexer key, per shared layer the selected latents only."""

from __future__ import annotations

from pathlib import Path

from afdserve.bench.decode import DecodeBench, run_decode_bench
from afdserve.model.fixtures.tiny import make_tiny_model

CONTEXT, STEPS, BATCH, BLOCK = 10, 3, 3, 4


def test_decode_bench_counts_selected_latents_and_all_keys(tmp_path: Path) -> None:
    model = make_tiny_model(tmp_path / "glm", "glm_moe_dsa", seed=4)
    bench = DecodeBench(
        model_dir=str(model),
        preset=None,
        random_weights=False,
        batch_sizes=(1, BATCH),
        context_len=CONTEXT,
        steps=STEPS,
        dtype="float32",
        device="cpu",
        block_size=BLOCK,
    )
    results, _ = run_decode_bench(bench)
    assert [r.batch for r in results] == [1, BATCH]
    # Timed positions 13, 14, 15 (as tests/bench/test_bench_v4.py), float32: latents 32 + 8 wide,
    # 4 selected; keys 16 wide, position + 1 of them; layers 0 and 2 full, 1 and 3 shared.
    per_step = {p: 4 * (2 * (4 * 40 + (p + 1) * 16) + 2 * 4 * 40) for p in (13, 14, 15)}
    assert per_step == {13: 4352, 14: 4480, 15: 4608}
    mean = sum(per_step.values()) / 3
    assert [r.kv_bytes for r in results] == [int(mean), int(BATCH * mean)]
    assert all(r.step_ms > 0 and r.weight_bytes > 0 for r in results)
