"""DeepSeek-V3.2 and GLM-5 (DSA) under graph_mode `full`, as a replay runs it, on CPU: every
step (prefill chunks beside decodes) from the graph's static buffers alone (cuda_graphs.
UbatchBuffers: as many segments as rows, the ones past the step's empty, block tables as wide as
max_model_len whose columns past a sequence's blocks keep an earlier step's, no host segments),
so the indexer's key writes, the selection (`select_batched`, the torch form of the Triton
kernels' contract) and GLM-5's shared layers read only what a captured graph reads. The tokens
are the eager engine's (per-sequence selection from host segments), which tests/model/test_dsa.py
holds to transformers; colocated and in-process 1A1F with two ubatches."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.model.families import cache_layout, family_of, parse_model_config
from afdserve.model.families.dsa import attention as dsa_attention
from afdserve.model.families.dsa import cache as dsa_cache
from afdserve.model.families.dsa.cache import DSAPages
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.engine.test_gated_deltanet_engine import GraphBuffersOnCPU

FAMILIES = ("deepseek_v32", "glm_moe_dsa")
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, ignore_eos=True)
BLOCK = 4
BUDGET = 11  # tokens a step: prefill chunks of up to 11 rows beside decodes


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(3)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 3, 7, 13, 29)]


@pytest.fixture(scope="module", params=FAMILIES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("dsa-g") / request.param, request.param, seed=1)


@pytest.fixture(scope="module")
def eager(model: Path) -> list[list[int]]:
    with LLM(str(model), dtype="float32", block_size=BLOCK, max_num_batched_tokens=BUDGET) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


def _host_segments_read(*args) -> torch.Tensor:
    raise AssertionError("a replayed step selected from host segments")


class StaticBuffersOnCPU(GraphBuffersOnCPU):
    """`GraphBuffersOnCPU` whose replays hand the layers no host segments: DSA's layers read
    the device segments alone, so a replay runs exactly the static inputs a graph captured."""

    def _run(self, plan, boundary) -> torch.Tensor:
        return self.runner.forward(self._static_inputs(plan), plan, boundary)


def full_graph_tokens(model: Path, split: dict) -> tuple[list[list[int]], list]:
    """The greedy tokens of graph_mode full with every step replayed from the static buffers
    (`StaticBuffersOnCPU`), and the replays' (key, segment row counts)."""
    ubatches = 2 if split else 1
    with LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK,
        graph_mode="full",
        cuda_graph_sizes=[1, 2, 4, 8, 12],
        max_num_batched_tokens=BUDGET,
        ubatches=ubatches,
        **split,
    ) as llm:
        forward = llm.engine.core_client.driver.forward
        assert forward.graphs is None  # CPU: the graph steps would run eagerly
        forward.graphs = StaticBuffersOnCPU(
            forward.runner, 12, llm.engine.max_model_len, ubatches=ubatches
        )
        forward.graphs.replays = []
        got = [o.token_ids for o in llm.generate(prompts(), GREEDY)]
        return got, forward.graphs.replays


@pytest.mark.parametrize("split", [{}, {"topology": "1A1F", "connector": "inprocess"}])
def test_full_graph_buffers_give_the_eager_tokens(model, eager, split, monkeypatch) -> None:
    """Graphs of one key replay different mixes of prefill chunks and decode rows; a prefill
    chunk of 11 rows on 2 ubatches falls on both sides of the boundary, a step of 1 row leaves
    the second ubatch empty."""
    monkeypatch.setattr(DSAPages, "batched_segments", True)  # device segments, as on CUDA
    # Every step replays: none takes the eager prefill path's per-sequence selection.
    monkeypatch.setattr(dsa_attention, "select_per_segment", _host_segments_read)
    got, replays = full_graph_tokens(model, split)
    assert got == eager and len({tuple(t) for t in eager}) == len(eager)
    mixed = [key for key, rows in replays if 1 in rows and max(rows) > 1]
    assert mixed, replays
    mixes = {key: {rows for k, rows in replays if k == key} for key in mixed}
    assert any(len(seen) > 1 for seen in mixes.values()), replays


def test_full_is_refused_by_name_without_triton(monkeypatch) -> None:
    """Where Triton loads `full` captures DSA's mixed steps; without it the torch path's
    captured selection would gather every row's keys out to max_model_len: refused, by name."""
    config = parse_model_config(family_of("deepseek_v32").presets["deepseek-v3.2"])
    monkeypatch.setattr(dsa_cache.ops, "triton_available", lambda: True)
    assert cache_layout(config).graph_refusal("full") is None
    monkeypatch.setattr(dsa_cache.ops, "triton_available", lambda: False)
    assert cache_layout(config).graph_refusal("full") == dsa_cache.FULL_GRAPH_REFUSAL
    assert cache_layout(config).graph_refusal("full_decode_only") is None
