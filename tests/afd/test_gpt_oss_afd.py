"""gpt-oss under AFD over real rank processes (gloo): 2A1F, 3A2F and an expert-parallel FFN group
give the colocated greedy tokens, token for token. The router's bias and the experts' biases
travel as the other families' weights do; with expert parallelism each shard adds the down
bias only for the pairs it holds, and the group's sum is the whole."""

from __future__ import annotations

from pathlib import Path

import pytest

from afdserve import LLM
from afdserve.model.fixtures.tiny import make_tiny_model

from .conftest import GREEDY, colocated_tokens, mixed_prompts


@pytest.fixture(scope="module")
def gpt_oss_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str | None, Path]:
    """bf16-layout (float32) and MXFP4 tiny checkpoints."""
    root = tmp_path_factory.mktemp("gpt-oss-afd")
    return {
        quant: make_tiny_model(root / str(quant), "gpt_oss", seed=3, quantization=quant)
        for quant in (None, "mxfp4")
    }


CASES = [
    # topology, ubatches, gate_on_attention, expert parallel, quantization
    pytest.param("2A1F", 2, False, False, None, id="2A1F"),
    pytest.param("3A2F", 1, True, False, None, id="3A2F-gate", marks=pytest.mark.slow),
    pytest.param("1A2F", 1, False, True, None, id="1A2F-expert-parallel"),
    pytest.param("2A2F", 2, True, True, None, id="2A2F-expert-parallel", marks=pytest.mark.slow),
    pytest.param("1A2F", 1, False, True, "mxfp4", id="1A2F-mxfp4", marks=pytest.mark.slow),
]


@pytest.mark.parametrize(("topology", "ubatches", "gate", "expert_parallel", "quant"), CASES)
def test_gpt_oss_afd_matches_colocated(
    gpt_oss_models, topology, ubatches, gate, expert_parallel, quant
):
    gpt_oss_model = gpt_oss_models[quant]
    prompts = mixed_prompts()  # a chunked prefill (past the window) beside decodes
    with LLM(
        str(gpt_oss_model),
        topology=topology,
        dtype="float32",
        ubatches=ubatches,
        gate_on_attention=gate,
        max_num_batched_tokens=16,
        ffn_expert_parallel=expert_parallel,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == colocated_tokens(gpt_oss_model, prompts)


def test_gpt_oss_in_process_1a1f_with_graph_layouts(gpt_oss_models):
    """Both halves in one process under `full` graphs' padded layouts (pad rows through the
    sinks, windows and biased experts, their outputs dropped) and 3 ubatches."""
    model = gpt_oss_models[None]
    prompts = mixed_prompts()
    with LLM(
        str(model),
        topology="1A1F",
        connector="inprocess",
        dtype="float32",
        ubatches=3,
        gate_on_attention=True,
        graph_mode="full",
        cuda_graph_sizes=[1, 2, 4, 8],
        max_num_batched_tokens=8,
    ) as llm:
        got = [o.token_ids for o in llm.generate(prompts, GREEDY)]
    assert got == colocated_tokens(model, prompts)
