"""`bench decode --num-speculative-tokens` on a GPU with the `tiny` preset: verification steps
(1 + k rows a sequence) replayed from the engine's decode graphs pick the eager steps' tokens,
and the bench times them beside plain steps under graphs. On a DeepSeek-V3 checkpoint with its
MTP layer, the step's draft passes replay their own graphs and draft the eager passes' tokens."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from afdserve.bench.decode import DecodeBench, DecodeSteps, build_halves, run_verify_bench
from afdserve.bench.decode_steps import build_drafts
from afdserve.layout.plan import DRAFT_TAGS
from afdserve.model.config import read_hf_config
from afdserve.model.fixtures.tiny import make_tiny_model
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


@pytest.mark.parametrize("topology", ["colocated", "in-process"])
def test_mtp_draft_passes_replay_their_graphs_in_the_verification_step(tmp_path, topology):
    """k = 2, float32: every step's main tokens and both drafts of each sequence equal the eager
    steps'; the draft passes captured a graph of each kind once and replayed it after."""
    model = str(make_tiny_model(tmp_path / "v3", "deepseek_v3", seed=4, mtp_layers=1))
    raw = read_hf_config(model)
    common = dict(model_dir=model, preset=None, random_weights=False, dtype="float32")
    eager_spec = spec(**common, topology=topology)
    graphed_spec = spec(**common, topology=topology, graph_mode="full_decode_only")
    attn, ffn = build_halves(graphed_spec, raw)
    drafts = build_drafts(graphed_spec, raw, attn, ffn)
    eager = DecodeSteps(attn, ffn, eager_spec, 5, query_len=3, drafts=drafts)
    graphed = DecodeSteps(attn, ffn, graphed_spec, 5, query_len=3, drafts=drafts)
    for step in range(5):
        want = (eager.step()[0].clone(), eager.drafts.last.clone())
        got = (graphed.step()[0].clone(), graphed.drafts.last.clone())
        assert all(torch.equal(a, b) for a, b in zip(want, got)), f"step {step}: {want} {got}"
    passes = graphed.drafts.passes
    assert {key[-1] for key in passes.graphs} == set(DRAFT_TAGS) and not passes.eager_keys
    records = [r for r in graphed.driver.recorder.records if r["role"] == "attention"]
    assert [r["draft_modes"] for r in records] == [["capture"] * 2] + [["replay"] * 2] * 4


def test_verify_bench_times_mtp_draft_passes_under_graphs(tmp_path):
    model = str(make_tiny_model(tmp_path / "v3", "deepseek_v3", seed=4, mtp_layers=1))
    s = spec(model_dir=model, preset=None, random_weights=False, graph_mode="full_decode_only")
    plain, verify = run_verify_bench(dataclasses.replace(s, num_speculative_tokens=1))
    for step, r in zip(plain, verify, strict=True):
        assert r.mtp_timed and r.mtp_cost == 0 and r.verify_ms > 0 and step.step_ms > 0
