"""DeepSeek-V3.2 and GLM-5 (DSA) under AFD over real gloo worlds: the indexer, its key pages and
the selection GLM-5's shared layers reuse all stay on the attention ranks, and the greedy tokens
are the colocated engine's, token for token (float32), with chunked prefill beside decodes, the
gate on either side, ubatches, expert-parallel FFN groups and the decode-graph layout on CPU."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM
from afdserve.model.fixtures.tiny import make_tiny_model

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, collectives, warmup_steps

SLOW = pytest.mark.slow
CASES = [
    # topology, family, ubatches, budget, gate_on_attention, graph mode, ffn_expert_parallel
    pytest.param("2A1F", "glm_moe_dsa", 2, 16, True, "none", False, id="2A1F-glm-u2-gate"),
    pytest.param("2A1F", "deepseek_v32", 1, 16, False, "full_decode_only", False, marks=SLOW),
    pytest.param("3A2F", "deepseek_v32", 2, 16, False, "none", False, marks=SLOW),
    pytest.param("3A2F", "glm_moe_dsa", 1, 8, True, "full_decode_only", False, marks=SLOW),
    pytest.param("2A2F", "deepseek_v32", 1, 16, True, "none", True, marks=SLOW),
    pytest.param("1A2F", "glm_moe_dsa", 2, 16, False, "none", True, marks=SLOW),
]
GRAPH_SIZES = [1, 2, 4, 8]


@pytest.fixture(scope="module")
def dsa_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsa-afd")
    return {f: make_tiny_model(root / f, f, seed=3) for f in ("deepseek_v32", "glm_moe_dsa")}


@pytest.mark.parametrize(
    ("topology", "family", "ubatches", "budget", "gate", "graph_mode", "expert_parallel"), CASES
)
def test_dsa_afd_matches_colocated(
    dsa_models, tmp_path, topology, family, ubatches, budget, gate, graph_mode, expert_parallel
):
    model = dsa_models[family]
    prompts = mixed_prompts()  # a 70-token prompt, chunked under the budget, beside decodes
    with LLM(
        str(model),
        topology=topology,
        dtype="float32",
        ubatches=ubatches,
        max_num_batched_tokens=budget,
        gate_on_attention=gate,
        graph_mode=graph_mode,
        cuda_graph_sizes=GRAPH_SIZES,
        ffn_expert_parallel=expert_parallel,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    records = llm.step_log()
    assert got == colocated_tokens(model, prompts)
    assert any(r["real_rows"] == budget for r in records if r["role"] == "attention")
    warmup = warmup_steps(graph_mode, GRAPH_SIZES)
    assert assert_data_plane_matches_plan(tmp_path, records, warmup) > 0
    if expert_parallel:
        assert collectives(tmp_path)
    if graph_mode != "none":
        assert {"capture", "replay"} <= {r["mode"] for r in records}
