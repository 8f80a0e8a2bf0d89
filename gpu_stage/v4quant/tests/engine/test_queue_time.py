"""Queue time as vLLM means it: from the engine accepting a request to the first step that
computes any of its tokens. The oracle is the test's own clock around an engine that can run
one request at a time (max_num_seqs=1), in this process so that both read the same clock."""

from __future__ import annotations

import time

import pytest

from afdserve import LLM, SamplingParams

LONG = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)


@pytest.fixture(scope="module")
def one_at_a_time():
    with LLM(max_num_seqs=1) as llm:
        yield llm


def test_a_queued_request_waits_for_the_whole_run_before_it(one_at_a_time: LLM) -> None:
    engine = one_at_a_time.engine
    engine.add_request("first", [5, 6, 7], LONG)
    engine.add_request("second", [8, 9], LONG)
    added = time.monotonic()  # both arrived before this
    first_step_done = None
    finished = {}
    while len(finished) < 2:
        outputs = engine.step()
        now = time.monotonic()
        first_step_done = first_step_done or now
        for out in outputs:
            if out.finished:
                finished[out.request_id] = (out, now)
    first, first_seen = finished["first"]
    second, _ = finished["second"]
    # "second" cannot start before the step that finished "first" has returned.
    assert second.queue_time >= first_seen - added > 0
    assert second.first_scheduled_time >= first_seen
    assert first.queue_time <= first_step_done - first.arrival_time
    for out in (first, second):
        assert out.arrival_time <= out.first_scheduled_time <= out.first_token_time


def test_offline_outputs_carry_the_engine_times(one_at_a_time: LLM) -> None:
    outs = one_at_a_time.generate([[5, 6, 7], [8, 9]], LONG, use_tqdm=False)
    first, second = outs
    assert second.first_scheduled_time - second.arrival_time >= (
        first.first_token_time - first.first_scheduled_time
    )
    for out in outs:
        assert out.arrival_time <= out.first_scheduled_time <= out.first_token_time
