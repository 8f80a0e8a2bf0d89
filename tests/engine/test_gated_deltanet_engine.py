"""The delta-rule hybrids (Qwen3-Next, Qwen3.5-MoE, Kimi-Linear) in the colocated engine:
chunked prefill (chunks of a few tokens, so the state and the convolution window cross chunk
boundaries), preemption by recompute (a slot changes hands and a victim restarts from position
0), the decode-graph layout and two ubatches (a sequence's rows split between them) all give the
one-shot greedy tokens, which tests/model/test_gated_deltanet.py holds equal to transformers;
every slot and block is free at the end."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.model.fixtures.tiny import make_tiny_model
from tests.engine.test_llm import run

MODEL_TYPES = ("qwen3_next", "qwen3_5_moe", "kimi_linear")
NEW_TOKENS = 12
GREEDY = SamplingParams(max_tokens=NEW_TOKENS, temperature=0.0, ignore_eos=True)
BLOCK = 4


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, 256, (n,), generator=gen).tolist() for n in (1, 3, 7, 13, 29)]


@pytest.fixture(scope="module", params=MODEL_TYPES)
def model(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_model(tmp_path_factory.mktemp("gdn-e") / request.param, request.param, seed=2)


@pytest.fixture(scope="module")
def one_shot(model: Path) -> list[list[int]]:
    with LLM(str(model), dtype="float32", block_size=BLOCK) as llm:
        return [o.token_ids for o in llm.generate(prompts(), GREEDY)]


@pytest.mark.parametrize("budget", [3, 5])
def test_chunked_prefill_gives_the_one_shot_tokens(model, one_shot, budget: int) -> None:
    with LLM(str(model), dtype="float32", block_size=BLOCK, max_num_batched_tokens=budget) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot


def test_preemption_by_recompute_keeps_the_tokens(model, one_shot) -> None:
    blocks = -(-(29 + NEW_TOKENS) // BLOCK) + 1  # the longest sequence and one block more
    llm = LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK,
        kv_cache_blocks=blocks,
        max_num_batched_tokens=7,
        max_num_seqs=3,
    )
    outs, preempted = run(llm, prompts(), GREEDY, late={3: 4})
    assert preempted > 0
    assert [o.token_ids for o in outs] == one_shot
    manager = llm.engine.core_client.core.block_manager
    assert manager.num_free_blocks == blocks
    assert manager.num_slots == 3 and manager.num_free_slots == 3


def test_decode_graph_layout_keeps_the_tokens(model, one_shot) -> None:
    """graph_mode full_decode_only as it runs on CPU: decode steps padded to the capture sizes,
    pad segments (slot -1) writing the scratch slot, one batched step per layer."""
    with LLM(
        str(model),
        dtype="float32",
        block_size=BLOCK,
        graph_mode="full_decode_only",
        cuda_graph_sizes=[1, 2, 4, 8],
        log_step_plan=True,
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot
        modes = {r["mode"] for r in llm.step_log()}
    assert {"capture", "replay"} <= modes


def test_two_ubatches_split_sequences_and_keep_the_tokens(model, one_shot) -> None:
    """In-process 1A1F with two ubatches: a prefill's rows fall on both sides of the ubatch
    boundary, the second part resuming from the state the first left."""
    with LLM(
        str(model),
        topology="1A1F",
        connector="inprocess",
        dtype="float32",
        block_size=BLOCK,
        ubatches=2,
        max_num_batched_tokens=9,
    ) as llm:
        assert [o.token_ids for o in llm.generate(prompts(), GREEDY)] == one_shot
