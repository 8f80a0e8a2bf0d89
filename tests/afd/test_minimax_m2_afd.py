"""MiniMax-M2 under AFD over real gloo worlds (rank processes): the greedy tokens equal the
colocated engine's token for token (float32), with chunked prefill beside decodes, the gate on
either side, ubatches and expert-parallel FFN groups; the data plane carries the plan's rows."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM
from afdserve.model.fixtures.tiny import make_tiny_model

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, collectives

SLOW = pytest.mark.slow
CASES = [
    # topology, ubatches, budget, gate_on_attention, ffn_expert_parallel
    pytest.param("2A1F", 2, 16, True, False, id="2A1F-u2-gate"),
    pytest.param("1A2F", 1, 16, False, True, id="1A2F-ep", marks=SLOW),
    pytest.param("3A2F", 2, 16, False, False, id="3A2F-u2", marks=SLOW),
    pytest.param("3A2F", 1, 8, True, True, id="3A2F-ep-gate", marks=SLOW),
    pytest.param("2A4F", 2, 16, False, True, id="2A4F-ep-u2", marks=SLOW),
]


@pytest.fixture(scope="module")
def minimax(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("minimax-afd") / "m2", "minimax_m2", seed=3)


@pytest.mark.parametrize(("topology", "ubatches", "budget", "gate", "expert_parallel"), CASES)
def test_minimax_m2_afd_matches_colocated(
    minimax, tmp_path, topology, ubatches, budget, gate, expert_parallel
):
    prompts = mixed_prompts()  # a 70-token prompt, chunked under the budget, beside decodes
    with LLM(
        str(minimax),
        topology=topology,
        dtype="float32",
        ubatches=ubatches,
        max_num_batched_tokens=budget,
        gate_on_attention=gate,
        ffn_expert_parallel=expert_parallel,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    records = llm.step_log()
    assert got == colocated_tokens(minimax, prompts)
    assert any(r["real_rows"] == budget for r in records if r["role"] == "attention")
    assert assert_data_plane_matches_plan(tmp_path, records, warmup_steps=0) > 0
    if expert_parallel:
        assert collectives(tmp_path)  # the group exchanged rows
