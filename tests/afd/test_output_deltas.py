"""Rank processes send each request's step as a delta (`OutputDelta`); the frontend rebuilds the
cumulative outputs. Oracle: the one-process engine's own outputs, step by step, with logprobs,
stop strings held back and multi-byte text."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.afd.clients.process import OutputAccumulator
from afdserve.afd.ranks.messages import OutputDelta
from afdserve.afd.ranks.world import WorkerError


def _engine_outputs(params: list[SamplingParams], prompts: list[str]):
    with LLM(None) as llm:
        engine = llm.engine
        prompt_ids = {}
        for i, (prompt, p) in enumerate(zip(prompts, params)):
            ids = llm.tokenizer.encode(prompt)
            prompt_ids[f"r{i}"] = ids
            engine.add_request(f"r{i}", ids, p)
        steps = []
        while engine.has_unfinished:
            steps.append(engine.step())
    return prompt_ids, steps


def test_deltas_rebuild_every_output_the_engine_gave():
    prompts = ["Hello", "naïve café — 東京", "abc abc abc", "x"]
    params = [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=["b", "zz"]),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]
    prompt_ids, steps = _engine_outputs(params, prompts)
    acc = OutputAccumulator()
    for request_id, ids in prompt_ids.items():
        acc.start(request_id, ids)
    rebuilt = 0
    for outputs in steps:
        for out in outputs:
            assert acc.add(OutputDelta.of(out)) == out
            rebuilt += 1
    assert rebuilt > len(prompts)  # several steps per request were rebuilt, not just the last


def test_a_delta_that_does_not_add_up_is_a_protocol_error():
    acc = OutputAccumulator()
    acc.start("r", [1, 2])
    delta = OutputDelta("r", (7,), "a", (), False, None, 2, 0.0, None, None)
    with pytest.raises(WorkerError, match="counts 2 tokens, its deltas add up to 1"):
        acc.add(delta)
