"""Reasoning parsers together with tool calls, against real servers (bundled tiny model, one
per reasoning/tool parser pair) through the official `openai` client, whole and streamed.

For "auto", a regex makes the tiny model write a think block that itself holds a call (which
must stay reasoning, as in vLLM), then content and a call in the tool parser's format: the
expected reasoning_content, content and tool_calls are written out by hand. For "required" and
a named function the call's grammar comes after the think block (vLLM turns structured output
on after `</think>`); the grammar's language is checked on llguidance's own matcher, the served
answer against the offline API under the same grammar.
"""

from __future__ import annotations

import json
import re

import openai
import pytest

from afdserve import LLM, SamplingParams
from afdserve.engine.structured import StructuredOutputsParams
from afdserve.server.reasoned_tools import reasoned_grammar

from .conftest import SERVED_NAME, free_port, start_server

WEATHER = {
    "type": "object",
    "properties": {"city": {"enum": ["Paris", "Oslo"]}},
    "required": ["city"],
    "additionalProperties": False,
}
TOOLS = [
    {"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"enum": ["UTC", "CET"]}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
ASK = [{"role": "user", "content": "Weather in Oslo?"}]
OSLO = ("get_weather", {"city": "Oslo"})

HERMES_TIME = '<tool_call>{"name": "get_time", "arguments": {"zone": "UTC"}}</tool_call>'
HERMES_OSLO = '<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
CODER_TIME = (
    "<tool_call>\n<function=get_time>\n<parameter=zone>\nUTC\n</parameter>\n"
    "</function>\n</tool_call>"
)
CODER_OSLO = (
    "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
    "</function>\n</tool_call>"
)
DS_TIME = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_time\n```json\n"
    '{"zone": "UTC"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)
DS_OSLO = (
    "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
    '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
)

# (reasoning parser, tool parser, what the model writes, reasoning_content, content)
AUTO = {
    "qwen3+hermes": (
        "qwen3",
        "hermes",
        f"<think>\nNot {HERMES_TIME} yet.\n</think>\n\nChecking.{HERMES_OSLO}",
        f"\nNot {HERMES_TIME} yet.\n",
        "\n\nChecking.",
    ),
    "qwen3+qwen3_coder": (
        "qwen3",
        "qwen3_coder",
        f"<think>\nNot {CODER_TIME} yet.\n</think>\n\nChecking.\n{CODER_OSLO}",
        f"\nNot {CODER_TIME} yet.\n",
        "\n\nChecking.\n",
    ),
    "deepseek_r1+deepseek_v3": (
        "deepseek_r1",
        "deepseek_v3",
        f"Not {DS_TIME} yet.</think>Checking.{DS_OSLO}",
        f"Not {DS_TIME} yet.",
        "Checking.",
    ),
}


# qwen3_coder shares Qwen3's reasoning with hermes: its server is the slow cell of the matrix.
CELLS = [pytest.param(name, marks=pytest.mark.slow) if "coder" in name else name for name in AUTO]


@pytest.fixture(scope="module", params=CELLS)
def served(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    reasoning, tool_parser = AUTO[request.param][:2]
    srv = start_server(
        tmp_path_factory.mktemp("reasoned-tools"),
        free_port(),
        topology="colocated",
        enable_auto_tool_choice=True,
        tool_call_parser=tool_parser,
        reasoning_parser=reasoning,
    )
    try:
        srv.wait_healthy()
        client = openai.OpenAI(base_url=f"{srv.url}/v1", api_key="x", max_retries=0, timeout=120)
        yield request.param, client
    finally:
        srv.stop()


@pytest.fixture(scope="module")
def oracle():
    with LLM() as llm:
        yield llm


def forced(text: str, max_tokens: int = 400) -> dict:
    return {
        "messages": ASK,
        "tools": TOOLS,
        "temperature": 0.0,
        "max_tokens": max_tokens,
        "extra_body": {"structured_outputs": {"regex": re.escape(text)}},
    }


def streamed(client: openai.OpenAI, **request: object) -> tuple[str, str, list, str | None]:
    """(reasoning_content, content, [(name, arguments)], finish_reason) put together from the
    deltas, as a client of vLLM's stream does."""
    reasoning, content, calls, finish = "", "", {}, None
    for chunk in client.chat.completions.create(model=SERVED_NAME, stream=True, **request):
        for choice in chunk.choices:
            finish = choice.finish_reason or finish
            reasoning += getattr(choice.delta, "reasoning_content", None) or ""
            content += choice.delta.content or ""
            for delta in choice.delta.tool_calls or []:
                call = calls.setdefault(delta.index, ["", ""])
                call[0] += delta.function.name or ""
                call[1] += delta.function.arguments or ""
    return reasoning, content, [(n, json.loads(a)) for n, a in calls.values()], finish


def test_auto_calls_come_only_from_the_content_after_the_reasoning(served) -> None:
    name, client = served
    _, _, text, reasoning, content = AUTO[name]
    request = forced(text)
    (choice,) = client.chat.completions.create(model=SERVED_NAME, **request).choices
    calls = [
        (c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []
    ]
    assert calls == [OSLO], "the call inside the think block is reasoning, not a call"
    assert choice.message.reasoning_content == reasoning  # type: ignore[attr-defined]
    assert choice.message.content == content and choice.finish_reason == "tool_calls"
    assert streamed(client, **request) == (reasoning, content, [OSLO], "tool_calls")


def test_auto_reasoning_that_never_ends_holds_no_call(served) -> None:
    """No `</think>`: all of an R1 answer is reasoning, so the call in it is not read; a Qwen3
    answer cut inside its think block likewise."""
    name, client = served
    parser, _, text, _, _ = AUTO[name]
    think_only = text[: text.index("</think>")]
    (choice,) = client.chat.completions.create(model=SERVED_NAME, **forced(think_only)).choices
    expected = think_only.removeprefix("<think>")
    assert choice.message.reasoning_content == expected  # type: ignore[attr-defined]
    assert not choice.message.tool_calls and not choice.message.content
    assert choice.finish_reason == "stop"
    reasoning, content, calls, finish = streamed(client, **forced(think_only))
    assert (reasoning, content, calls, finish) == (expected, "", [], "stop"), parser


@pytest.mark.parametrize("parser", ["qwen3", "deepseek_r1"])
def test_the_forced_call_grammar_is_reasoning_then_the_call(oracle: LLM, parser: str) -> None:
    import llguidance
    import llguidance.hf

    model = oracle.engine_config.model
    grammar = StructuredOutputsParams(
        grammar=reasoned_grammar(WEATHER, parser), tokenizer_dir=model
    )
    grammar.check()
    tokenizer = oracle.get_tokenizer()
    vocabulary = llguidance.hf.from_tokenizer(tokenizer)

    def accepts(text: str) -> bool:
        matcher = llguidance.LLMatcher(vocabulary, grammar.llguidance_grammar())
        ids = tokenizer.encode(text, add_special_tokens=False)
        return all(matcher.consume_token(t) for t in ids) and matcher.is_accepting()

    opened = "<think>" if parser == "qwen3" else ""
    call = '{"city":"Oslo"}'
    assert accepts(f"{opened}free {HERMES_TIME} text</think>{call}")
    assert not accepts(f'{opened}thinking</think>{{"city":"Rome"}}')  # the schema holds
    assert not accepts(f"{opened}one</think>{call}</think>{call}")  # the first </think> ends it
    assert not accepts(f"{opened}still thinking")
    assert accepts(call) == (parser == "qwen3")  # Qwen3 may answer without thinking


@pytest.mark.parametrize("choice", ["named", "required"])
def test_forced_calls_follow_the_reasoning(served, oracle: LLM, choice: str) -> None:
    """tool_choice under a reasoning parser: the served answer is the offline API's under the
    same grammar, split into reasoning_content and the call (the tiny model may answer Qwen3's
    grammar without thinking; a think block it opens it does not close within max_tokens)."""
    name, client = served
    parser = AUTO[name][0]
    if choice == "named":
        tool_choice: object = {"type": "function", "function": {"name": "get_weather"}}
        schema = WEATHER
    else:
        tool_choice = "required"
        schema = {
            "type": "array",
            "minItems": 1,
            "maxItems": 1,
            "items": {
                "anyOf": [
                    {
                        "type": "object",
                        "properties": {"name": {"enum": ["get_weather"]}, "parameters": WEATHER},
                        "required": ["name", "parameters"],
                        "additionalProperties": False,
                    }
                ]
            },
        }
    tools = TOOLS[:1]
    request = {
        "messages": ASK,
        "tools": tools,
        "temperature": 0.0,
        "max_tokens": 40,
        "tool_choice": tool_choice,
        "parallel_tool_calls": False,
    }
    params = StructuredOutputsParams(
        grammar=reasoned_grammar(schema, parser), tokenizer_dir=oracle.engine_config.model
    )
    expected = oracle.chat(
        ASK,
        SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=params),
        use_tqdm=False,
    )[0]
    (answer,) = client.chat.completions.create(model=SERVED_NAME, **request).choices
    thinking = answer.message.reasoning_content  # type: ignore[attr-defined]
    stream = streamed(client, **request)
    if parser == "qwen3" and not expected.text.startswith("<think>"):
        reasoning, written = None, expected.text  # Qwen3 answered without thinking
    else:
        reasoning, _, written = expected.text.removeprefix("<think>").partition("</think>")
    assert thinking == reasoning
    if written:  # the call after the reasoning
        arguments = json.loads(written)
        if choice == "required":
            arguments = arguments[0]["parameters"]
        assert arguments["city"] in ("Paris", "Oslo")
        (call,) = answer.message.tool_calls
        assert (call.function.name, json.loads(call.function.arguments)) == (
            "get_weather",
            arguments,
        )
        finish = "stop" if choice == "named" else "tool_calls"
        assert answer.finish_reason == finish
        assert stream == (reasoning or "", "", [("get_weather", arguments)], finish)
    else:  # cut inside the think block: all of it reasoning, no call
        assert expected.finish_reason == "length"
        assert not answer.message.tool_calls and answer.finish_reason == "length"
        assert stream[0] == reasoning and stream[2:] == ([], "length")
