"""Rank processes send each request's step as token ids only (`TokenDelta`); the frontend's output
processor detokenizes, applies stop strings and keeps the cumulative outputs. Oracle: the
one-process engine's own outputs, step by step, with logprobs, stop strings held back and
multi-byte text; and for the offline API, colocated generate() with stop strings, n > 1 and
logprobs."""

from __future__ import annotations

import dataclasses
import math
import time

import pytest

from afdserve import LLM, SamplingParams
from afdserve.afd.ranks.messages import Outputs
from afdserve.engine.requests import TokenDelta
from afdserve.engine.tokenizer import load_tokenizer
from afdserve.frontend.outputs import SequenceOutput
from afdserve.model.fixtures.bundled import resolve_model

PROMPTS = ["Hello", "naïve café — 東京", "abc abc abc", "x"]


def _params(stop: str) -> list[SamplingParams]:
    """`stop` completes a few tokens into prompt 2's greedy output: held back, then found."""
    return [
        SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True, logprobs=2),
        SamplingParams(max_tokens=10, temperature=0.8, seed=3, ignore_eos=True),
        SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True, stop=[stop, "zz"]),
        SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True),
    ]


TIMES = ("arrival_time", "first_scheduled_time", "first_token_time")


def _stream(llm: LLM, params: list[SamplingParams]) -> dict[str, list[SequenceOutput]]:
    """Every output of every request, step by step."""
    engine = llm.engine
    for i, (prompt, p) in enumerate(zip(PROMPTS, params)):
        engine.add_request(f"r{i}", llm.tokenizer.encode(prompt, add_special_tokens=False), p)
    series: dict[str, list[SequenceOutput]] = {f"r{i}": [] for i in range(len(PROMPTS))}
    deadline = time.monotonic() + 120
    while engine.has_unfinished:
        for out in engine.step():
            series[out.request_id].append(out)
        assert time.monotonic() < deadline
    return series


def _without_times(out: SequenceOutput) -> dict:
    fields = dataclasses.asdict(out)
    for name in TIMES:
        fields.pop(name)
    return fields


def _close(a: list, b: list) -> bool:
    """Logprobs of two runs: the same tokens, values within float32 noise."""
    if len(a) != len(b):
        return False
    for x, y in zip(a, b):
        if (x is None) != (y is None) or (x is not None and x.keys() != y.keys()):
            return False
        if x is not None and not all(math.isclose(x[t], y[t], abs_tol=1e-4) for t in x):
            return False
    return True


def _same(got: dict, want: dict) -> None:
    got_lp, want_lp = got.pop("logprobs"), want.pop("logprobs")
    assert got == want
    assert _close(got_lp, want_lp)


@pytest.fixture(scope="module")
def colocated() -> tuple[list[SamplingParams], dict[str, list[SequenceOutput]]]:
    with LLM(None, dtype="float32") as llm:
        free = llm.generate(
            PROMPTS[2],
            SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        stop = free.outputs[0].text[2:4]
        assert len(stop) == 2 and "zz" not in free.outputs[0].text
        params = _params(stop)
        return params, _stream(llm, params)


@pytest.fixture(scope="module")
def two_ranks():
    with LLM(None, topology="2A1F", dtype="float32") as llm:
        yield llm


def _capture_messages(llm: LLM, monkeypatch: pytest.MonkeyPatch) -> list[Outputs]:
    """What the ranks send the frontend, as it arrives (before the core client filters it)."""
    world = llm.engine.core_client.world
    received: list[Outputs] = []
    messages = world.messages

    def recording(timeout: float, waker=None) -> list:
        msgs = messages(timeout, waker)
        received.extend(msg for msg in msgs if isinstance(msg, Outputs))
        return msgs

    monkeypatch.setattr(world, "messages", recording)
    return received


def test_the_streamed_pieces_add_up(colocated) -> None:
    params, series = colocated
    tokenizer = load_tokenizer(resolve_model(None))
    for request_id, outs in series.items():
        assert outs and outs[-1].finished and not any(o.finished for o in outs[:-1])
        final = outs[-1]
        assert [t for o in outs for t in o.new_token_ids] == final.token_ids
        assert "".join(o.new_text for o in outs) == final.text
        full = tokenizer.decode(final.token_ids, skip_special_tokens=True)
        for out in outs:
            assert full.startswith(out.text)
        if request_id != "r2":
            assert final.text == full
    stopped = series["r2"][-1]
    stop = params[2].stop[0]
    assert stopped.finish_reason == "stop" and stop not in stopped.text
    rest = tokenizer.decode(stopped.token_ids, skip_special_tokens=True)[len(stopped.text) :]
    assert rest.startswith(stop) and len(stopped.token_ids) < 16
    # The stop string's first character came a step before its last, and was held back.
    assert any(
        o.text == stopped.text and o.token_ids != stopped.token_ids for o in series["r2"][:-1]
    )
    assert len(series["r0"][-1].logprobs) == 12
    assert len(series["r3"]) == 1  # one token: its only output is also the last


def test_ranks_stream_what_the_one_process_engine_gives(
    colocated, two_ranks: LLM, monkeypatch: pytest.MonkeyPatch
) -> None:
    params, series = colocated
    received = _capture_messages(two_ranks, monkeypatch)
    got = _stream(two_ranks, params)
    assert got.keys() == series.keys()
    for request_id, want in series.items():
        assert len(got[request_id]) == len(want), request_id
        for a, b in zip(got[request_id], want):
            _same(_without_times(a), _without_times(b))
    # What the ranks sent: token ids and logprobs, never text.
    deltas = [d for msg in received for d in msg.outputs]
    assert deltas and all(type(d) is TokenDelta for d in deltas)
    assert {f.name for f in dataclasses.fields(TokenDelta)}.isdisjoint({"text", "new_text"})
    for delta in deltas:
        strings = {name for name, value in vars(delta).items() if isinstance(value, str)}
        assert strings <= {"request_id", "finish_reason"}
    assert all(all(type(t) is int for t in d.new_token_ids) for d in deltas)


def test_offline_api_with_stop_strings_n_and_logprobs_matches_colocated(two_ranks: LLM) -> None:
    prompts = ["Hello", "abc abc abc", [5, 6, 7]]
    params = [
        SamplingParams(max_tokens=12, temperature=0.8, seed=1, n=2, logprobs=1, stop=["o", "q"]),
        SamplingParams(
            max_tokens=16,
            temperature=0.0,
            ignore_eos=True,
            stop=["b"],
            logprobs=2,
            include_stop_str_in_output=True,
        ),
        SamplingParams(max_tokens=10, temperature=0.7, seed=4, n=3, best_of=4, logprobs=0),
    ]
    got = two_ranks.generate(prompts, params, use_tqdm=False)
    with LLM(None, dtype="float32") as llm:
        want = llm.generate(prompts, params, use_tqdm=False)
    assert [len(o.outputs) for o in got] == [2, 1, 3]
    assert any(c.finish_reason == "stop" and len(c.token_ids) < 16 for o in want for c in o.outputs)
    for a, b in zip(got, want, strict=True):
        assert a.prompt_token_ids == b.prompt_token_ids and a.finished and b.finished
        for x, y in zip(a.outputs, b.outputs, strict=True):
            assert (x.index, x.text, x.token_ids, x.finish_reason) == (
                y.index,
                y.text,
                y.token_ids,
                y.finish_reason,
            )
            assert _close(x.logprobs, y.logprobs)
            assert math.isclose(x.cumulative_logprob, y.cumulative_logprob, abs_tol=1e-3)


def test_a_stop_string_frees_the_request_on_its_rank(two_ranks: LLM) -> None:
    """The frontend finds the stop string and aborts the request at its rank: the rank stops
    stepping it and frees its KV blocks, long before max_tokens could have run out."""
    engine = two_ranks.engine
    free = two_ranks.generate(
        [[5, 6, 7]], SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True), use_tqdm=False
    )[0]
    stop = free.outputs[0].text[2:4]
    assert stop
    max_tokens = 400
    engine.add_request(
        "stopped",
        [5, 6, 7],
        SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True, stop=[stop]),
    )
    rank = engine.core_client.owner["stopped"]
    before = sum(engine.core_client.rank_stats[rank].steps.values())
    finished = None
    while finished is None:
        finished = next((o for o in engine.step() if o.finished), None)
    assert finished.finish_reason == "stop" and len(finished.token_ids) < 8
    assert "stopped" not in engine.core_client.owner and not engine.has_unfinished
    deadline = time.monotonic() + 60
    while True:  # the rank's stats come with each of its messages (a heartbeat when idle)
        engine.step()
        stats = engine.core_client.rank_stats[rank]
        if stats.running == 0 and stats.kv_cache_usage == 0.0:
            break
        assert time.monotonic() < deadline
    assert sum(stats.steps.values()) - before < max_tokens // 4
