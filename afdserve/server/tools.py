"""Tool calls on chat, as vLLM serves them.

`tool_choice` "required" or a named function: the answer is constrained by a JSON schema
(structured output), so the model can only write a valid call: a named function's `parameters`
object, or for "required" a non-empty JSON array of {"name", "parameters"} items, one of the
tools each. The server turns that JSON into OpenAI's `tool_calls`.

"auto" (the default once tools are given): the model decides, in its own format, which a parser
reads (`--enable-auto-tool-choice --tool-call-parser hermes`, server/tool_parsers.py); without
them it is a 400, as in vLLM. "none" (and no tools) leaves the answer free.

Finish reasons follow OpenAI: "stop" for a named function, "tool_calls" for "required" and for
"auto" answers that call.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from afdserve.server import protocol as api
from afdserve.server import responses as shape
from afdserve.server.protocol import bad_request
from afdserve.server.tool_parsers import ToolCallStream, parse_calls

ANY_OBJECT: dict[str, Any] = {"type": "object"}


@dataclass(frozen=True)
class ToolChoice:
    """A forced tool call: `name` for a named function, None for "required"."""

    name: str | None
    schema: dict[str, Any]

    @property
    def constraint(self) -> dict[str, Any]:
        """The StructuredOutputsParams fields of the forced answer."""
        return {"json": self.schema}

    @property
    def finish_reason(self) -> str:
        return "stop" if self.name is not None else "tool_calls"

    def message(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        """A whole answer: its tool_calls, or (cut by max_tokens) the text as it is."""
        calls = self.calls(text) if finish == "stop" else None
        if calls is None:
            return shape.chat_choice(index, text, logprobs, finish)
        return tool_message(index, None, calls, logprobs, self.finish_reason)

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def calls(self, text: str) -> list[dict] | None:
        """OpenAI tool_calls from the constrained answer; None when it is not a complete call
        (the answer was cut by max_tokens)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return [call(self.name, text)]
        return [
            call(item["name"], json.dumps(item["parameters"], ensure_ascii=False)) for item in value
        ]


class AutoTools:
    """tool_choice "auto" read by a tool-call parser (tool_parsers.PARSERS)."""

    constraint = None

    def __init__(self, parser: str = "hermes") -> None:
        self.parser = parser

    def message(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        content, calls = parse_calls(text, self.parser)
        if not calls:
            return shape.chat_choice(index, text, logprobs, finish)
        finish = "tool_calls" if finish == "stop" else finish
        return tool_message(
            index, content or None, [call(n, a) for n, a in calls], logprobs, finish
        )

    def stream(self) -> AutoToolStream:
        return AutoToolStream(self.parser)


def tool_message(
    index: int, content: str | None, calls: list[dict], logprobs: dict | None, finish: str | None
) -> dict:
    message = {"role": "assistant", "content": content, "tool_calls": calls}
    return shape.message_choice(index, message, logprobs, finish)


def call(name: str, arguments: str) -> dict:
    return {
        "id": f"chatcmpl-tool-{uuid.uuid4().hex}",
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def tool_choice(
    body: api.ChatCompletionRequest, parser: str | None = None
) -> ToolChoice | AutoTools | None:
    """How the request's tools are answered: a forced call, the parser's reading of a free
    answer ("auto" with a `parser`), or None (no tools, or tool_choice "none")."""
    tools = body.tools or []
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    if choice == "none":
        return None
    if not tools:
        raise bad_request("tool_choice: needs tools", "tool_choice")
    if choice == "auto":
        if parser is not None:
            return AutoTools(parser)
        raise bad_request(
            'tool_choice: "auto" needs a tool-call parser (serve with --enable-auto-tool-choice '
            '--tool-call-parser hermes); or use "required", a named function, or "none"',
            "tool_choice",
        )
    functions = {tool.function.name: tool.function.parameters or ANY_OBJECT for tool in tools}
    if choice == "required":
        items = [
            {
                "type": "object",
                "properties": {"name": {"enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in functions.items()
        ]
        one = body.parallel_tool_calls is False
        return ToolChoice(
            None,
            {
                "type": "array",
                "minItems": 1,
                "items": {"anyOf": items},
                **({"maxItems": 1} if one else {}),
            },
        )
    assert isinstance(choice, api.NamedToolChoice)
    name = choice.function.name
    if name not in functions:
        raise bad_request(
            f"tool_choice: function {name!r} is not among the tools "
            f"({', '.join(sorted(functions))})",
            "tool_choice",
        )
    return ToolChoice(name, functions[name])


def template_tools(body: api.ChatCompletionRequest) -> list[dict] | None:
    """The tools as chat templates read them (transformers' `tools=`)."""
    if not body.tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in body.tools]


class ToolStream:
    """Streamed answers as OpenAI's tool_calls deltas. A named function's arguments stream as
    the model writes them (its name goes out with the role); "required" answers are a JSON
    array whose calls are known only at the end, so they go out whole with the last chunk."""

    def __init__(self, forced: ToolChoice) -> None:
        self.forced = forced
        self.texts: dict[int, str] = {}

    def opening(self, head: dict, n: int) -> tuple[dict, ...]:
        def first() -> dict:
            delta: dict[str, Any] = {"role": "assistant", "content": None}
            if self.forced.name is not None:
                delta["tool_calls"] = [{"index": 0, **call(self.forced.name, "")}]
            return delta

        return shape.role_chunks(head, n, first)

    def delta(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        delta: dict[str, Any] = {}
        if self.forced.name is not None:
            if text:
                delta = {"tool_calls": [{"index": 0, "function": {"arguments": text}}]}
        else:
            self.texts[index] = self.texts.get(index, "") + text
            calls = self.forced.calls(self.texts[index]) if finish == "stop" else None
            if calls is not None:
                delta = {"tool_calls": [{"index": k, **c} for k, c in enumerate(calls)]}
                finish = self.forced.finish_reason
            elif finish is not None and self.texts[index]:
                delta = {"content": self.texts[index]}
        return shape.delta_choice(index, delta, logprobs, finish)


class AutoToolStream:
    """Streamed "auto" answers: content as it comes, each call whole once its block closes."""

    def __init__(self, parser: str = "hermes") -> None:
        self.parser = parser
        self.streams: dict[int, ToolCallStream] = {}
        self.calls: dict[int, int] = {}

    def opening(self, head: dict, n: int) -> tuple[dict, ...]:
        return shape.role_chunks(head, n)

    def delta(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        stream = self.streams.setdefault(index, ToolCallStream(self.parser))
        content, calls = stream.feed(text, final=finish is not None)
        delta: dict[str, Any] = {"content": content} if content else {}
        if calls:
            first = self.calls.get(index, 0)
            delta["tool_calls"] = [
                {"index": first + k, **call(name, arguments)}
                for k, (name, arguments) in enumerate(calls)
            ]
            self.calls[index] = first + len(calls)
        if finish == "stop" and self.calls.get(index):
            finish = "tool_calls"
        return shape.delta_choice(index, delta, logprobs, finish)
