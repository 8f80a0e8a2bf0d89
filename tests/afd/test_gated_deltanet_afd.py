"""The delta-rule hybrids (Qwen3-Next, Qwen3.5-MoE, Kimi-Linear) under AFD over real gloo
worlds: every attention rank keeps its own state slots beside its own blocks (the linear layers'
state never crosses to the FFN side, only the normed rows do), the shared experts (Qwen's gated
one) run on the FFN ranks, and the greedy tokens equal colocated ones token for token (float32):
2A1F, 3A2F, expert-parallel groups, the gate on either side, one or two ubatches, a chunked
prefill beside decodes."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM
from afdserve.model.fixtures.tiny import make_tiny_model

from .conftest import GREEDY, colocated_tokens, mixed_prompts
from .wire_logs import assert_data_plane_matches_plan, collectives

SLOW = pytest.mark.slow
CASES = [
    # topology, model_type, ubatches, gate_on_attention, ffn_expert_parallel
    pytest.param("2A1F", "qwen3_next", 2, False, False, id="2A1F-next-u2"),
    pytest.param("3A2F", "qwen3_5_moe", 1, True, False, id="3A2F-3.5-gate", marks=SLOW),
    pytest.param("2A2F", "qwen3_next", 2, True, True, id="2A2F-next-ep", marks=SLOW),
    pytest.param("1A2F", "qwen3_5_moe", 1, False, True, id="1A2F-3.5-ep", marks=SLOW),
    pytest.param("2A1F", "kimi_linear", 2, True, False, id="2A1F-kimi-u2-gate", marks=SLOW),
    pytest.param("3A2F", "kimi_linear", 1, False, True, id="3A2F-kimi-ep", marks=SLOW),
]


@pytest.fixture(scope="module")
def gdn_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gdn-afd")
    types = ("qwen3_next", "qwen3_5_moe", "kimi_linear")
    return {t: make_tiny_model(root / t, t, seed=3) for t in types}


@pytest.mark.parametrize(("topology", "model_type", "ubatches", "gate", "expert_parallel"), CASES)
def test_gdn_afd_matches_colocated(
    gdn_models, tmp_path, topology, model_type, ubatches, gate, expert_parallel
) -> None:
    model = gdn_models[model_type]
    prompts = mixed_prompts()  # a 70-token prompt, chunked under the budget, beside decodes
    with LLM(
        str(model),
        topology=topology,
        dtype="float32",
        ubatches=ubatches,
        max_num_batched_tokens=16,
        gate_on_attention=gate,
        ffn_expert_parallel=expert_parallel,
        log_step_plan=True,
        log_data_plane=str(tmp_path),
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == colocated_tokens(model, prompts)
    records = llm.step_log()
    assert assert_data_plane_matches_plan(tmp_path, records, 0) > 0
    if expert_parallel:
        assert collectives(tmp_path)  # the group exchanged rows
    # A chunked prefill really ran: a step holding a whole budget of rows.
    assert any(r["real_rows"] == 16 for r in records if r["role"] == "attention")
