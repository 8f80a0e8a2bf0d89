"""The hermes tool-call parser: whole answers against hand-written expectations, and streamed
answers (any split into deltas) against the whole answer's parse."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from afdserve.server.tool_parsers import HermesStream, ToolCallStream, parse_calls, parse_hermes

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
TIME = '<tool_call>{"name": "get_time", "arguments": "{\\"zone\\": \\"UTC\\"}"}</tool_call>'


@pytest.mark.parametrize(
    ("text", "content", "calls"),
    [
        ("Just text.", "Just text.", []),
        (WEATHER, "", [("get_weather", '{"city": "Oslo"}')]),
        ("Let me check." + WEATHER, "Let me check.", [("get_weather", '{"city": "Oslo"}')]),
        (
            WEATHER + "\n" + TIME,
            "\n",
            [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')],
        ),
        # The last call may be left open when the answer ends.
        ('<tool_call>{"name": "f", "arguments": {}}', "", [("f", "{}")]),
        # Not a call: kept as content, tags and all.
        ("a<tool_call>not json</tool_call>b", "a<tool_call>not json</tool_call>b", []),
        (
            '<tool_call>{"arguments": {}}</tool_call>',
            '<tool_call>{"arguments": {}}</tool_call>',
            [],
        ),
        ('cut <tool_call>{"name": "f", "argu', 'cut <tool_call>{"name": "f", "argu', []),
        ("a < b <tool", "a < b <tool", []),
    ],
)
def test_whole_answers(text: str, content: str, calls: list) -> None:
    assert parse_hermes(text) == (content, calls)
    for _, arguments in calls:
        json.loads(arguments)


pieces = st.sampled_from(
    [
        "Hi ",
        "a<b ",
        "<tool",
        "_call>",
        "</tool_call>",
        WEATHER,
        TIME,
        "\n",
        "<tool_call>x",
        '{"name": "g", "arguments": {}}',
        "é✓",
    ]
)


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


# ----- the other formats, as the models write them -----

DEEPSEEK = (
    "Let me look.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function'
    '<｜tool▁sep｜>get_time\n```json\n{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
KIMI = (
    "Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0"
    '<|tool_call_argument_begin|>{"city": "Oslo"}<|tool_call_end|><|tool_call_begin|>'
    'functions.get_time:1<|tool_call_argument_begin|>{"zone": "UTC"}<|tool_call_end|>'
    "<|tool_calls_section_end|>"
)
QWEN3_CODER = (
    "Sure.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>\n<tool_call>\n"
    "<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n</function>\n</tool_call>"
)
FORMAT_CASES = [
    (
        "deepseek_v3",
        DEEPSEEK,
        "Let me look.\n",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')],
    ),
    (
        "kimi_k2",
        KIMI,
        "Checking.",
        [("get_weather", '{"city": "Oslo"}'), ("get_time", '{"zone": "UTC"}')],
    ),
    (
        "qwen3_coder",
        QWEN3_CODER,
        "Sure.\n\n",
        [("get_weather", '{"city": "Oslo", "days": 3}'), ("get_time", '{"zone": "UTC"}')],
    ),
    # Not a call in the format: kept as content.
    (
        "deepseek_v3",
        "<｜tool▁call▁begin｜>nonsense<｜tool▁call▁end｜>",
        "<｜tool▁call▁begin｜>nonsense<｜tool▁call▁end｜>",
        [],
    ),
    (
        "qwen3_coder",
        '<tool_call>{"name": "f"}</tool_call>',
        '<tool_call>{"name": "f"}</tool_call>',
        [],
    ),
    ("kimi_k2", "plain answer", "plain answer", []),
]


@pytest.mark.parametrize(("parser", "text", "content", "calls"), FORMAT_CASES)
def test_formats_as_the_models_write_them(parser: str, text: str, content: str, calls) -> None:
    assert parse_calls(text, parser) == (content, calls)


@settings(max_examples=150, deadline=None)
@given(st.sampled_from(FORMAT_CASES), st.lists(st.integers(1, 9), max_size=40))
def test_every_format_streams_to_its_whole_parse(case: tuple, cuts: list[int]) -> None:
    parser, text = case[0], case[1] + " done"
    stream, content, calls, pos = ToolCallStream(parser), "", [], 0
    for size in cuts:
        new_content, new_calls = stream.feed(text[pos : pos + size], final=False)
        content, calls, pos = content + new_content, calls + new_calls, pos + size
    new_content, new_calls = stream.feed(text[pos:], final=True)
    assert (content + new_content, calls + new_calls) == parse_calls(text, parser)
