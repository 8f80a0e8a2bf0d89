"""Tool calls after the reasoning (`--reasoning-parser` with tools), as vLLM serves them: the
thinking goes to `reasoning_content` and is never read for calls; the calls come only from the
content after it (server/reasoning.py splits, tools.py reads what is left).

- "auto": the parser (tool_parsers.py) reads the content, whole or as it settles in the stream;
  a call written inside the think block stays reasoning.
- "required" or a named function: vLLM turns the grammar off while the model reasons and on
  after `</think>`. Here one llguidance grammar says the same: the think block (free text up to
  the first `</think>`; optional for qwen3, whose answers may not think), then the constrained
  JSON. So the model reasons first and the call follows it.
"""

from __future__ import annotations

import json
from typing import Any

from afdserve.server import responses as shape
from afdserve.server import tools
from afdserve.server.reasoning import END, START, ReasoningStream, split_reasoning

Inner = tools.ToolChoice | tools.AutoTools


def reasoned_grammar(schema: dict[str, Any], parser: str) -> str:
    """A Lark grammar (llguidance's dialect): the parser's think block, then `schema`'s JSON.
    The think lexeme is lazy: it ends at the first `</think>`, as split_reasoning reads it."""
    end = END.replace("/", "\\/")
    if parser == "qwen3":  # Qwen3 opens the block itself, or writes none
        start, think = "start: think? call", f"think[lazy]: /{START}(.|\\n)*{end}/"
    else:  # deepseek_r1: the template opened it; a leading <think> is part of the free text
        start, think = "start: think call", f"think[lazy]: /(.|\\n)*{end}/"
    compact = {**schema, "x-guidance": {"whitespace_flexible": False}}
    return f"{start}\n{think}\ncall: %json {json.dumps(compact)}\n"


class Reasoned:
    """An answering of tools.py (a forced call or "auto") behind a reasoning parser."""

    def __init__(self, inner: Inner, parser: str) -> None:
        self.inner, self.parser = inner, parser

    @property
    def constraint(self) -> dict[str, Any] | None:
        schema = self.inner.constraint
        if schema is None:
            return None
        return {"grammar": reasoned_grammar(schema["json"], self.parser)}

    def message(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        thinking, content = split_reasoning(text, self.parser)
        choice = self.inner.message(index, content, logprobs, finish)
        choice["message"]["reasoning_content"] = thinking
        return choice

    def stream(self) -> ReasonedStream:
        return ReasonedStream(self.inner.stream(), self.parser)


class ReasonedStream:
    """Each delta split by a ReasoningStream: the thinking goes out as `reasoning_content`, the
    content on to the inner stream (tool-call deltas, or content as it settles). A named
    function's call is announced with its first arguments, after the reasoning (vLLM's order),
    not with the role: an answer cut while thinking then announces no call."""

    def __init__(self, inner: tools.ToolStream | tools.AutoToolStream, parser: str) -> None:
        self.inner, self.parser = inner, parser
        self.splits: dict[int, ReasoningStream] = {}
        forced = getattr(inner, "forced", None)
        self.named = forced.name if forced is not None else None
        self.announced: set[int] = set()

    def opening(self, head: dict, n: int) -> tuple[dict, ...]:
        if self.named is not None:
            return shape.role_chunks(head, n)
        return self.inner.opening(head, n)

    def delta(self, index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
        split = self.splits.setdefault(index, ReasoningStream(self.parser))
        thinking, content = split.feed(text, final=finish is not None)
        choice = self.inner.delta(index, content, logprobs, finish)
        said = choice["delta"]
        if self.named is not None and content and index not in self.announced:
            self.announced.add(index)
            said["tool_calls"] = [{"index": 0, **tools.call(self.named, content)}]
        if thinking:
            choice["delta"] = {"reasoning_content": thinking, **said}
        return choice
