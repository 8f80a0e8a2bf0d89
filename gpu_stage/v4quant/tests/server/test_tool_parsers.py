"""The hermes tool-call parser: whole answers against hand-written expectations, and streamed
answers (any split into deltas) against the whole answer's parse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.server.tool_parsers import HermesStream, parse_hermes

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (WEATHER, "", [("get_weather", '{"city": "Oslo"}')]),
        ("Let me check." + WEATHER, "Let me check.",
         [("get_weather", '{"city": "Oslo"}')]),
        (WEATHER + "\n" + TIME, "\n",
         [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')]),
        # The last call may be left open when the answer ends.
        ('<tool_call>{"name": "f", "arguments": {}}', "", [("f", "{}")]),
        # Not a call: kept as content, tags and all.
        ("a<tool_call>not json</tool_call>b", "a<tool_call>not json</tool_call>b", []),
        ('<tool_call>{"arguments": {}}</tool_call>', '<tool_call>{"arguments": {}}</tool_call>',
         []),
        ("cut <tool_call>{\"name\": \"f\", \"argu", "cut <tool_call>{\"name\": \"f\", \"argu", []),
        ("a < b <tool", "a < b <tool", []),
    ],
)  # fmt: skip
def test_whole_answers(text: str, content: str, calls: list) -> None:
    assert parse_hermes(text) == (content, calls)
    for _, arguments in calls:
        json.loads(arguments)


pieces = st.sampled_from(
    ["Hi ", "a<b ", "<tool", "_call>", "</tool_call>", WEATHER, TIME, "\n", "<tool_call>x",
     '{"name": "g", "arguments": {}}', "é✓"]
)  # fmt: skip


@settings(max_examples=300, deadline=None)
@given(st.lists(pieces, max_size=8), st.lists(st.integers(1, 12), max_size=30))
def test_streamed_answers_add_up_to_the_whole_answer(parts: list[str], cuts: list[int]) -> None:
    text = "".join(parts)
    stream, content, calls, pos = HermesStream(), "", [], 0
    for size in cuts:
        new_content, new_calls = stream.feed(text[pos : pos + size], final=False)
        content, calls, pos = content + new_content, calls + new_calls, pos + size
    new_content, new_calls = stream.feed(text[pos:], final=True)
    assert (content + new_content, calls + new_calls) == parse_hermes(text)
