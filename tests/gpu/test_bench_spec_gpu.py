"""`bench decode --num-speculative-tokens` on a GPU with the `tiny` preset: verification steps
(1 + k rows a sequence) replayed from the engine's decode graphs pick the eager steps' tokens,
and the bench times them beside plain steps under graphs."""

from __future__ import annotations

import pytest
import torch

from afdserve.bench.decode import DecodeBench, DecodeSteps, build_halves, run_verify_bench
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
    [("colocated", 1, "full_decode_only"), ("in-process", 2, "full_decode_only")],
)
def test_verification_graph_replay_decodes_the_eager_tokens(topology, ubatches, graph_mode):
    s = spec(topology=topology, ubatches=ubatches, graph_mode=graph_mode)
    attn, ffn = build_halves(s, preset_hf_config("tiny"))
    eager = DecodeSteps(attn, ffn, spec(topology=topology, ubatches=ubatches), 5, query_len=3)
    graphed = DecodeSteps(attn, ffn, s, 5, query_len=3)
    want = [eager.step()[0].clone() for _ in range(5)]
    got = [graphed.step()[0].clone() for _ in range(5)]
    for step, (a, b) in enumerate(zip(want, got)):
        assert a.shape == (15,) and torch.equal(a, b), f"step {step}: {a.tolist()} {b.tolist()}"
    modes = [r["mode"] for r in graphed.driver.recorder.records if r["role"] == "attention"]
    assert modes == ["capture"] + ["replay"] * 4, modes


def test_verify_bench_times_both_steps_under_graphs():
    plain, verify = run_verify_bench(spec(graph_mode="full_decode_only", num_speculative_tokens=1))
    for step, r in zip(plain, verify, strict=True):
        assert r.plain_ms == step.step_ms > 0 and r.verify_ms > 0
