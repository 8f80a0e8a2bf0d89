"""The decode bench on DeepSeek-V4 on a GPU (graph mode none): the deepseek-v4-flash:4 preset
shrunk (FP8 projections, FP4 experts, bf16 pages) decodes the same greedy tokens colocated and
in-process 1A1F over its filled paged cache, the timing path runs end to end at a context that
crosses the window and HCA rate, full_decode_only replays the eager tokens, and `full` is
refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from afdserve.bench.decode import DecodeBench, DecodeSteps, build_halves, run_decode_bench
from afdserve.model.presets import preset_hf_config
from tests.bench.test_bench_v4 import SHRUNK

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture
def flash_dir(tmp_path: Path) -> Path:
    (tmp_path / "config.json").write_text(
        json.dumps({**preset_hf_config("deepseek-v4-flash:4"), **SHRUNK})
    )
    return tmp_path


def spec(model: Path, **overrides) -> DecodeBench:
    fields = dict(
        model_dir=str(model),
        preset=None,
        random_weights=True,
        batch_sizes=(1, 8),
        context_len=600,
        steps=3,
        dtype="bfloat16",
        device="cuda",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


def test_in_process_decodes_the_colocated_tokens_on_cuda(flash_dir: Path) -> None:
    raw = json.loads((flash_dir / "config.json").read_text())
    got = {}
    for topology in ("colocated", "in-process"):
        s = spec(flash_dir, topology=topology)
        attn, ffn = build_halves(s, raw)
        steps = DecodeSteps(attn, ffn, s, 8)
        got[topology] = [steps.step()[0].tolist() for _ in range(4)]
    assert got["in-process"] == got["colocated"]


def test_decode_bench_runs_v4_on_gpu(flash_dir: Path) -> None:
    s = spec(flash_dir)
    results, _ = run_decode_bench(s)
    one, eight = results
    assert abs(eight.kv_bytes - 8 * one.kv_bytes) < 8  # per sequence alike (int rounding)
    for r in results:
        assert r.step_ms > 0 and r.copy_gbps is not None and r.copy_gbps > 100
        assert 0 < r.achieved_gbps < r.copy_gbps * 1.5


def test_full_decode_only_decodes_the_eager_tokens(flash_dir: Path) -> None:
    """The decode bench's graph (8 rows, FP4 experts, bf16 pages) replays the tokens the eager
    steps give from the same filled cache."""
    raw = json.loads((flash_dir / "config.json").read_text())
    got = {}
    for mode in ("none", "full_decode_only"):
        s = spec(flash_dir, graph_mode=mode)
        attn, ffn = build_halves(s, raw)
        steps = DecodeSteps(attn, ffn, s, 8)
        got[mode] = [steps.step()[0].tolist() for _ in range(4)]
        if mode != "none":
            assert steps.driver.forward.graphs.graphs  # captured, then replayed
    assert got["full_decode_only"] == got["none"]


def test_full_graph_mode_is_refused_for_v4(flash_dir: Path) -> None:
    with pytest.raises(ValueError, match="not supported for family 'deepseek_v4' on CUDA yet"):
        run_decode_bench(spec(flash_dir, graph_mode="full"))
