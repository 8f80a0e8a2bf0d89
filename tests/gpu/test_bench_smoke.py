"""The decode benchmark on a GPU with the `tiny` preset: CUDA-graph replay decodes the same greedy
tokens as eager steps, and the timing path runs end to end."""

from __future__ import annotations

import pytest
import torch

from afdserve.bench.decode import DecodeBench, DecodeSteps, build_halves, run_decode_bench
from afdserve.bench.decode_steps import check_cache_fits
from afdserve.engine.kv_cache import bytes_per_block
from afdserve.model.presets import preset_hf_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def spec(**overrides) -> DecodeBench:
    fields = dict(
        model_dir=None,
        preset="tiny",
        random_weights=True,
        batch_sizes=(1, 5),
        context_len=40,
        steps=4,
        dtype="bfloat16",
        device="cuda",
    )
    fields.update(overrides)
    return DecodeBench(**fields)


@pytest.mark.parametrize(
    ("topology", "ubatches", "graph_mode"),
    [
        ("colocated", 1, "full_decode_only"),
        ("in-process", 2, "full_decode_only"),
        ("in-process", 1, "full"),
    ],
)
def test_graph_replay_decodes_the_eager_tokens(topology, ubatches, graph_mode):
    """The bench's steps go through the engine's graph runner: the first captures, the rest
    replay, and every step picks the eager steps' tokens."""
    s = spec(topology=topology, ubatches=ubatches, graph_mode=graph_mode)
    attn, ffn = build_halves(s, preset_hf_config("tiny"))
    eager = DecodeSteps(attn, ffn, spec(topology=topology, ubatches=ubatches), 5)
    graphed = DecodeSteps(attn, ffn, s, 5)
    want = [eager.step()[0].clone() for _ in range(6)]
    got = [graphed.step()[0].clone() for _ in range(6)]
    for step, (a, b) in enumerate(zip(want, got)):
        assert torch.equal(a, b), f"step {step}: eager {a.tolist()} graph {b.tolist()}"
    records = graphed.driver.recorder.records
    modes = [r["mode"] for r in records if r["role"] == "attention"]
    assert modes == ["capture"] + ["replay"] * 5, modes


@pytest.mark.parametrize("graph_mode", ["none", "full"])
def test_decode_bench_runs_on_gpu(graph_mode):
    results, _ = run_decode_bench(spec(graph_mode=graph_mode))
    for r in results:
        assert r.step_ms > 0 and r.copy_gbps is not None and r.copy_gbps > 100
        assert 0 < r.achieved_gbps < r.copy_gbps * 1.5


def test_a_cache_past_free_memory_is_refused_by_its_batch_and_context():
    """A batch whose paged cache cannot fit (batch 256 at context 8192 of Qwen3-30B-A3B needs
    about 200 GiB) is a ValueError naming them and the bytes, raised before any allocation;
    one that fits passes."""
    attn, _ = build_halves(spec(), preset_hf_config("tiny"))
    config, dev = attn.config, torch.device("cuda")
    free = torch.cuda.mem_get_info(dev)[0]
    per_block = bytes_per_block(config, 16, torch.bfloat16)
    too_many = free // per_block + 1
    with pytest.raises(ValueError, match=r"a batch of 256 at context 8192 needs .* GiB .*free"):
        check_cache_fits(config, 256, 8192, too_many, 16, torch.bfloat16, dev)
    check_cache_fits(config, 1, 40, 4, 16, torch.bfloat16, dev)
