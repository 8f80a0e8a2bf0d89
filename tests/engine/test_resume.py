"""A request resumed on another engine from its prompt plus the tokens it had (what the server
does after a rank failure): the same tokens, text, logprobs and finish as an undisturbed run, for
greedy and seeded sampling, with penalties, min_tokens and a stop string held back across the
move. Oracle: the same requests run undisturbed on the one-process engine."""

from __future__ import annotations

import time

import pytest
import torch

from afdserve import LLM, SamplingParams
from afdserve.engine.sequence import Sequence, skip_draws
from afdserve.frontend.client import EngineClient

PROMPTS = ["Hello", "naïve café — 東京", "abc abc abc", "x y z", "The"]


def _params(stop: str) -> list[SamplingParams]:
    return [
        SamplingParams(max_tokens=14, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=14, temperature=0.9, seed=3, ignore_eos=True, top_k=20),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop, "zz"]),
        SamplingParams(
            max_tokens=12,
            temperature=1.1,
            seed=-7,
            frequency_penalty=0.7,
            repetition_penalty=1.3,
            ignore_eos=True,
        ),
        SamplingParams(max_tokens=10, temperature=0.7, seed=11, min_tokens=8),
    ]


def _run(engine: EngineClient, ids: list[str], streams: dict[str, list[str]]) -> dict:
    """Step until every request in `ids` finished; returns the final outputs by id."""
    finals = {}
    deadline = time.monotonic() + 120
    while len(finals) < len(ids):
        for out in engine.step():
            streams[out.request_id].append(out.new_text)
            if out.finished:
                finals[out.request_id] = out
        assert time.monotonic() < deadline
    return finals


@pytest.fixture(scope="module")
def engines() -> tuple[LLM, LLM]:
    first, second = LLM(topology="colocated"), LLM(topology="colocated")
    yield first, second
    first.shutdown()
    second.shutdown()


@pytest.mark.parametrize("after_steps", [1, 5])
def test_a_request_resumed_on_another_engine_goes_on_as_if_undisturbed(
    engines: tuple[LLM, LLM], after_steps: int
) -> None:
    llm, other = engines
    prompts = [llm.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]
    plain = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    greedy = llm.generate([prompts[2]], plain)[0].outputs[0].text
    params = _params(stop=greedy[6:9])  # completes a few tokens in: held back, then found
    ids = [f"r{i}" for i in range(len(prompts))]

    undisturbed: dict[str, list[str]] = {i: [] for i in ids}
    for rid, prompt, p in zip(ids, prompts, params):
        llm.engine.add_request(rid, prompt, p)
    want = _run(llm.engine, ids, undisturbed)

    # The same requests: a few steps on one engine, then resumed on another from their progress.
    moved = [f"m{i}" for i in range(len(prompts))]
    streams: dict[str, list[str]] = {i: [] for i in moved}
    for rid, prompt, p in zip(moved, prompts, params):
        llm.engine.add_request(rid, prompt, p)
    finals = {}
    for _ in range(after_steps):
        for out in llm.engine.step():
            streams[out.request_id].append(out.new_text)
            if out.finished:
                finals[out.request_id] = out
    generated = {}
    for rid, p in zip(moved, params):
        if rid in finals:
            continue
        progress = llm.engine.take_progress(rid)
        llm.engine.core_client.abort(rid)  # the old engine forgets it, as a dead one would
        assert progress is not None
        generated[rid] = len(progress.token_ids)
        other.engine.resume_request(rid, p, progress)
    assert any(generated.values()), "some request should have tokens before the move"
    finals.update(_run(other.engine, [r for r in moved if r not in finals], streams))

    for rid, mid in zip(ids, moved):
        got, expected = finals[mid], want[rid]
        assert got.token_ids == expected.token_ids, (rid, generated.get(mid))
        assert got.text == expected.text
        assert "".join(streams[mid]) == "".join(undisturbed[rid]) == expected.text
        assert got.finish_reason == expected.finish_reason
        assert [sorted(e) if e else e for e in got.logprobs] == [
            sorted(e) if e else e for e in expected.logprobs
        ]


def test_a_seeded_sequence_resumed_draws_what_it_would_have_drawn() -> None:
    """The k-th output token of a seeded sequence takes the k-th uniform of its seed's stream."""
    params = SamplingParams(temperature=1.0, seed=42)
    reference = torch.Generator().manual_seed(42)
    draws = [torch.rand((), generator=reference, dtype=torch.float64) for _ in range(6)]
    resumed = Sequence("r", [1, 2], params, None, output_token_ids=[5, 6, 7, 8])
    assert resumed.token_ids == [1, 2, 5, 6, 7, 8] and resumed.num_output_tokens == 4
    assert torch.rand((), generator=resumed.generator, dtype=torch.float64) == draws[4]
    skipped = torch.Generator().manual_seed(42)
    skip_draws(skipped, 2)
    assert torch.rand((), generator=skipped, dtype=torch.float64) == draws[2]
