"""Reasoning parsers on answers as DeepSeek-R1 and Qwen3 write them: whole answers against
hand-written expectations, streamed answers (any split into deltas) against the whole parse."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.server.reasoning import ReasoningStream, split_reasoning

CASES = [
    # R1: the template opened the block, the answer starts inside it.
    (
        "deepseek_r1",
        "Let me think.\n</think>\n\nThe answer is 4.",
        "Let me think.\n",
        "\n\nThe answer is 4.",
    ),
    ("deepseek_r1", "<think>\nhmm</think>4", "\nhmm", "4"),
    ("deepseek_r1", "still thinking, cut by max_tokens", "still thinking, cut by max_tokens", ""),
    ("qwen3", "<think>\nOkay, 2+2.\n</think>\n\n4", "\nOkay, 2+2.\n", "\n\n4"),
    (
        "qwen3",
        "4, without thinking (enable_thinking=false)",
        None,
        "4, without thinking (enable_thinking=false)",
    ),
    ("qwen3", "<think>\ncut", "\ncut", ""),
    ("qwen3", "a < b </think> c", None, "a < b </think> c"),
]


@pytest.mark.parametrize(("parser", "text", "reasoning", "content"), CASES)
def test_whole_answers(parser: str, text: str, reasoning: str | None, content: str) -> None:
    assert split_reasoning(text, parser) == (reasoning, content)


@settings(max_examples=200, deadline=None)
@given(st.sampled_from(CASES), st.lists(st.integers(1, 6), max_size=30))
def test_streamed_answers_add_up_to_the_whole_answer(case: tuple, cuts: list[int]) -> None:
    parser, text = case[0], case[1]
    stream, reasoning, content, pos = ReasoningStream(parser), "", "", 0
    for size in cuts:
        r, c = stream.feed(text[pos : pos + size], final=False)
        reasoning, content, pos = reasoning + r, content + c, pos + size
    r, c = stream.feed(text[pos:], final=True)
    whole = split_reasoning(text, parser)
    assert (reasoning + r, content + c) == (whole[0] or "", whole[1])
