"""The frontend's output processor: token deltas in, per-sequence outputs out; and the colocated
engine aborting, at the core, a request that a stop string (found by the frontend) finished."""

from __future__ import annotations

import pytest

from afdserve import LLM, SamplingParams
from afdserve.engine.requests import RequestError, TokenDelta
from afdserve.engine.tokenizer import TokenIdsOnly, load_tokenizer
from afdserve.frontend.client import EngineClient
from afdserve.frontend.output_processor import DeltaMismatch, OutputProcessor
from afdserve.model.fixtures.bundled import resolve_model


def delta(
    request_id: str,
    tokens: list[int],
    total: int,
    finished: bool = False,
    reason: str | None = None,
) -> TokenDelta:
    return TokenDelta(request_id, tuple(tokens), (), finished, reason, total, 0.0, None, None)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(resolve_model(None))  # byte-level: token b is byte b


def test_a_delta_that_does_not_add_up_is_a_protocol_error(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [1, 2], SamplingParams())
    with pytest.raises(DeltaMismatch, match="counts 2 tokens, its deltas add up to 1"):
        processor.process([delta("r", [7], 2)])


def test_deltas_after_a_stop_string_or_an_abort_are_dropped(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("s", [104], SamplingParams(max_tokens=10, stop=["ll"]))
    processor.add_request("a", [104], SamplingParams(max_tokens=10))
    first = processor.process([delta("s", [ord("e")], 1), delta("a", [ord("e")], 1)])
    assert [o.request_id for o in first.outputs] == ["s", "a"] and first.stopped == []
    # The last character could begin a stop string: it is held back until the next one.
    assert first.outputs[0].new_text == "" and first.outputs[1].new_text == "e"
    second = processor.process([delta("s", [ord("l")], 2)])
    assert second.outputs[0].new_text == "e" and not second.outputs[0].finished
    third = processor.process([delta("s", [ord("l")], 3)])
    (out,) = third.outputs
    assert (out.finished, out.finish_reason, out.text, third.stopped) == (True, "stop", "e", ["s"])
    processor.abort("a")
    # The core sent these before its abort arrived: nobody is waiting for them.
    late = processor.process([delta("s", [ord("o")], 4), delta("a", [ord("l")], 2)])
    assert late.outputs == [] and late.stopped == []
    assert "s" not in processor and "a" not in processor


def test_a_stop_string_on_the_last_allowed_token_finishes_as_stop(tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", [104], SamplingParams(max_tokens=2, stop=["ab"]))
    processor.process([delta("r", [ord("a")], 1)])
    done = processor.process([delta("r", [ord("b")], 2, finished=True, reason="length")])
    (out,) = done.outputs
    # The core finished it itself: nothing to abort there.
    assert (out.finish_reason, out.text, done.stopped) == ("stop", "", [])


def test_stop_strings_need_a_tokenizer() -> None:
    class NoCore:
        max_model_len, vocab_size = 64, 256

    client = EngineClient(NoCore(), TokenIdsOnly("/models/dummy"))  # type: ignore[arg-type]
    with pytest.raises(
        RequestError,
        match=r"stop: \['x'\] needs text, but the model directory "
        r"/models/dummy has no tokenizer; use stop_token_ids",
    ):
        client.add_request("r", [1, 2], SamplingParams(stop=["x"]))


def test_a_stop_string_aborts_the_request_at_the_core() -> None:
    with LLM(None, dtype="float32") as llm:
        engine = llm.engine
        core = engine.core_client.core
        free = llm.generate(
            [[5, 6, 7]],
            SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
            use_tqdm=False,
        )[0]
        stop = free.outputs[0].text[2:4]
        assert stop
        engine.add_request(
            "r",
            [5, 6, 7],
            SamplingParams(max_tokens=400, temperature=0.0, ignore_eos=True, stop=[stop]),
        )
        finished = None
        while finished is None:
            finished = next((o for o in engine.step() if o.finished), None)
        assert (
            finished.finish_reason == "stop"
            and finished.token_ids == free.outputs[0].token_ids[: len(finished.token_ids)]
        )
        # Aborted at the core within the same step(): not tracked, not scheduled, blocks free.
        assert "r" not in core.requests and not core.has_unfinished and not engine.has_unfinished
        assert core.block_manager.num_free_blocks == core.kv_cache.num_blocks
        assert engine.step() == []
