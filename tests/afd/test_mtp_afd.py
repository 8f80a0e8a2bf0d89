"""MTP drafts across rank processes (gloo): the MTP layer's attention half runs on the
attention ranks, its MoE rows cross to the FFN ranks as layer N, a draft pass of the plan
(layout/plan.py, rules 9 and 10) after each step, graphed where the main step is. Every
topology gives colocated's greedy tokens without speculation; a checkpoint whose drafts are
provably right has them accepted; one whose drafts hang on the MTP layer's experts accepts
exactly as many as colocated MTP does, so its MoE ran on the FFN ranks (sharded, in an expert
group) as it runs colocated."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from afdserve import LLM
from afdserve.afd.dataplane.wire import mirror_errors, read_wire_log
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.engine.test_mtp import N, _predictable

from .conftest import GREEDY, colocated_tokens, mixed_prompts


def mtp(k: int) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k}


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("mtp-afd") / "v3"
    return make_tiny_model(folder, "deepseek_v3", seed=4, mtp_layers=1)


@pytest.fixture(scope="module")
def expert_drafts(mtp_model, tmp_path_factory) -> str:
    """The provably-accepting checkpoint (tests/engine/test_mtp.py) with the MTP layer's
    expert and shared-expert outputs restored at 0.3 of their size: its drafts now hang on the
    layer's MoE, about half of them accepted."""
    folder = tmp_path_factory.mktemp("expert-drafts") / "m"
    model = _predictable(str(mtp_model), folder)
    original = load_file(Path(mtp_model) / "model.safetensors")
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.startswith(f"model.layers.{N}.mlp.") and name.endswith("down_proj.weight"):
            weights[name] = original[name] * 0.3
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return model


def generate(model, prompts, modes: set[str] | None = None, **kwargs):
    """Greedy tokens and the attention ranks' speculation counters, summed; `modes`, when
    given, collects the run modes of the step log."""
    if modes is not None:
        kwargs["log_step_plan"] = True
    with LLM(str(model), dtype="float32", **kwargs) as llm:
        tokens = [o.token_ids for o in llm.generate(prompts, GREEDY)]
        ranks = llm.engine.stats().spec_decode
    if modes is not None:
        modes.update(r["mode"] for r in llm.step_log())
        modes.update(f"draft {m}" for r in llm.step_log() for m in r.get("draft_modes", ()))
    drafted = sum(s.num_draft_tokens for s in ranks.values())
    accepted = sum(s.num_accepted_tokens for s in ranks.values())
    return tokens, drafted, accepted


def ffn_layer_rows(log_dir: Path, layer: int) -> int:
    """Real rows the FFN ranks received for `layer`, from their data-plane logs."""
    rows = 0
    for path in log_dir.glob("rank*.jsonl"):
        for line in path.read_text().splitlines():
            record = json.loads(line)
            if "header" in record and record["layer"] == layer:
                rows += record["real_rows"]
    return rows


CELLS = [
    pytest.param("2A1F", 1, {}, id="2A1F-k1"),
    pytest.param("3A2F", 1, {}, id="3A2F-k1", marks=pytest.mark.slow),
    pytest.param(
        "2A1F",
        2,
        {"ubatches": 2, "graph_mode": "full_decode_only", "cuda_graph_sizes": [1, 2, 4, 8]},
        id="2A1F-ub2-graphs-k2",
        marks=pytest.mark.slow,
    ),
    pytest.param("1A2F", 2, {"ffn_expert_parallel": True}, id="1A2F-ep-k2", marks=pytest.mark.slow),
    pytest.param(
        "2A2F",
        2,
        {"ffn_expert_parallel": True, "ubatches": 2, "gate_on_attention": True},
        id="2A2F-ep-ub2-gate-k2",
        marks=pytest.mark.slow,
    ),
    pytest.param("1A1F", 2, {"connector": "inprocess"}, id="1A1F-inprocess-k2"),
]


@pytest.mark.parametrize(("topology", "k", "kwargs"), CELLS)
def test_mtp_afd_matches_colocated(expert_drafts, tmp_path, topology, k, kwargs) -> None:
    """Colocated's tokens without speculation, and colocated MTP's acceptance exactly: the
    drafts hang on the MTP layer's experts, which ran on the FFN ranks (their logs show its
    rows); every batch one side posted, the other mirrored."""
    prompts = mixed_prompts()
    want = colocated_tokens(expert_drafts, prompts)
    _, drafted, accepted = generate(expert_drafts, prompts, speculative_config=mtp(k))
    logs, modes = tmp_path, set()
    got = generate(
        expert_drafts,
        prompts,
        modes,
        topology=topology,
        speculative_config=mtp(k),
        log_data_plane=str(logs),
        **kwargs,
    )
    assert got == (want, drafted, accepted)
    assert 0 < accepted < drafted
    assert ffn_layer_rows(logs, N) > 0
    # With graphs the main step and the draft passes after it capture and replay (on CPU
    # eagerly, in the graphs' layout), on both roles.
    assert ("replay" in modes) == ("draft replay" in modes) == ("graph_mode" in kwargs)
    if kwargs.get("connector") != "inprocess":
        assert mirror_errors(read_wire_log(str(p) for p in logs.glob("rank*.jsonl"))) == []


def test_provable_drafts_are_accepted_2a1f(mtp_model, tmp_path) -> None:
    """The checkpoint whose drafts are provably the main model's tokens: under 2A1F they are
    accepted (the drafts are really used), with colocated's tokens."""
    model = _predictable(str(mtp_model), tmp_path / "predictable")
    prompts = mixed_prompts()
    want = colocated_tokens(Path(model), prompts)
    got, drafted, accepted = generate(
        model, prompts, topology="2A1F", max_num_batched_tokens=16, speculative_config=mtp(1)
    )
    assert got == want
    assert drafted > 0 and accepted / drafted > 0.9


@pytest.mark.slow
def test_chunked_prefill_beside_drafts(mtp_model) -> None:
    """A budget of 16 (the long prompt's chunks beside decodes with drafts), k = 2, 3A2F."""
    prompts = mixed_prompts()
    want = colocated_tokens(mtp_model, prompts)
    got, drafted, _ = generate(
        mtp_model, prompts, topology="3A2F", max_num_batched_tokens=16, speculative_config=mtp(2)
    )
    assert got == want and drafted > 0


@pytest.mark.slow
@pytest.mark.parametrize("gate", [False, True], ids=["gate-ffn", "gate-attention"])
def test_hash_routed_main_layers(tmp_path, gate) -> None:
    """A checkpoint whose first MoE layer routes by token id: the main layers' ids travel as
    before and the MTP layer (a plain MoE layer) routes on its rows, the gate on either side."""
    model = make_tiny_model(tmp_path / "hash", "deepseek_v3", hash_layers=1, seed=4, mtp_layers=1)
    prompts = mixed_prompts()
    want = colocated_tokens(model, prompts)
    got, drafted, _ = generate(
        model, prompts, topology="2A1F", gate_on_attention=gate, speculative_config=mtp(2)
    )
    assert got == want and drafted > 0


@pytest.fixture(scope="module")
def v4_expert_drafts(tmp_path_factory) -> str:
    """DeepSeek-V4's provably-accepting checkpoint (tests/engine/test_mtp_v4.py) with the MTP
    layer's expert down projections restored at 0.5 of their size: its drafts hang on the
    layer's MoE, some accepted and some not."""
    from tests.engine.test_mtp_v4 import _predictable as v4_predictable

    root = tmp_path_factory.mktemp("v4-expert-drafts")
    model = make_tiny_model(root / "v4", "deepseek_v4", seed=2, mtp_layers=1)
    folder = root / "m"
    v4_predictable(str(model), folder)
    original = load_file(Path(model) / "model.safetensors")
    weights = load_file(folder / "model.safetensors")
    for name in weights:
        if name.startswith("mtp.0.ffn.") and name.endswith("w2.weight"):
            weights[name] = original[name] * 0.5
    save_file(weights, folder / "model.safetensors", metadata={"format": "pt"})
    return str(folder)


@pytest.mark.parametrize(
    "k", [pytest.param(2, id="k2"), pytest.param(1, id="k1", marks=pytest.mark.slow)]
)
def test_v4_mtp_under_afd_matches_colocated(v4_expert_drafts, k) -> None:
    """DeepSeek-V4's MTP layer under 2A1F: colocated's tokens without speculation, and as many
    drafts accepted as colocated MTP accepts (its MoE ran on the FFN rank as colocated)."""
    prompts = mixed_prompts()
    want = colocated_tokens(v4_expert_drafts, prompts)
    local, drafted_local, accepted_local = generate(
        v4_expert_drafts, prompts, max_num_batched_tokens=16, speculative_config=mtp(k)
    )
    got, drafted, accepted = generate(
        v4_expert_drafts,
        prompts,
        topology="2A1F",
        max_num_batched_tokens=16,
        speculative_config=mtp(k),
    )
    assert got == local == want
    assert 0 < accepted < drafted
    assert accepted == accepted_local
