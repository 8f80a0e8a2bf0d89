"""`LLM(data_parallel_size=N)`: N colocated engines, one rank process each, behind the frontend's
multi-rank client (topology <N>A0F). Oracle: one engine in this process; greedy tokens must be
identical per request, and the requests must really be spread over the replicas."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.frontend.process import ProcessClient

PROMPTS = [
    "Hello, my name is",
    "The capital of France",
    "1 2 3 4",
    "abc",
    "MoE models",
    "Once upon a time",
]


def greedy(llm: LLM, max_tokens: int = 10) -> list[list[int]]:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]


@pytest.fixture(scope="module")
def oracle() -> list[list[int]]:
    with LLM(device="cpu") as one:
        return greedy(one)


def test_two_replicas_give_the_tokens_of_one_engine(oracle: list[list[int]]) -> None:
    with LLM(data_parallel_size=2) as llm:
        assert llm.topology.attention_ranks == 2 and llm.topology.colocated
        assert llm.engine_config.device == "cpu" and llm.graph_config.mode == "none"
        core = llm.engine.core_client
        assert isinstance(core, ProcessClient)
        routed: list[int] = []
        add = core.world.send_many

        def spy(rank: int, messages: list) -> None:
            routed.extend(rank for _ in messages)
            add(rank, messages)

        core.world.send_many = spy
        assert greedy(llm) == oracle
        # Least outstanding work first: six equal requests alternate over the two replicas.
        assert sorted(set(routed)) == [0, 1] and routed.count(0) == routed.count(1)
        # Each replica is a whole engine with its own KV cache.
        assert all(ready.limits is not None for ready in llm.rank_ready.values())
