"""Tool-call parsers for `tool_choice: "auto"`: the model decides whether to call, in its own
format, and the server turns that text into OpenAI's `tool_calls`.

`hermes` is the format of Hermes, Qwen2.5 and Qwen3 chat templates (vLLM's parser of the same
name): each call is a JSON object {"name": ..., "arguments": {...}} between `<tool_call>` and
`</tool_call>` (the last one may be left open at the end of the answer). Everything else is the
message's content, a block whose JSON is not a call included, tags and all: nothing the model
wrote is dropped.

One segmentation serves whole and streamed answers. Streamed, it runs on what has not been sent
yet and leaves for later what may still change: a tail that could be the start of `<tool_call>`
and a block not closed yet. So the streamed content adds up to the whole answer's content and
the streamed calls are the whole answer's calls.
"""

from __future__ import annotations

import json

PARSERS = ("hermes",)
START, END = "<tool_call>", "</tool_call>"

Call = tuple[str, str]  # name, arguments (JSON text)
Segment = str | Call  # content, or a call


def segments(text: str, final: bool) -> tuple[list[Segment], int]:
    """The content pieces and calls of `text` in order, and how many characters they cover."""
    out: list[Segment] = []
    pos = 0
    while pos < len(text):
        start = text.find(START, pos)
        if start < 0:
            end = len(text) if final else len(text) - _start_prefix(text, pos)
            if end > pos:
                out.append(text[pos:end])
            return out, end
        if start > pos:
            out.append(text[pos:start])
        close = text.find(END, start + len(START))
        if close < 0 and not final:
            return out, start
        body_end = len(text) if close < 0 else close
        stop = len(text) if close < 0 else close + len(END)
        found = _call(text[start + len(START) : body_end])
        out.append(found if found is not None else text[start:stop])
        pos = stop
    return out, pos


def parse_hermes(text: str) -> tuple[str, list[Call]]:
    """(content, calls) of a whole answer."""
    parts, _ = segments(text, final=True)
    content = "".join(p for p in parts if isinstance(p, str))
    return content, [p for p in parts if isinstance(p, tuple)]


class HermesStream:
    """One streamed answer, fed its text deltas."""

    def __init__(self) -> None:
        self.text = ""
        self.done = 0  # characters already turned into segments

    def feed(self, delta: str, final: bool) -> tuple[str, list[Call]]:
        """(new content, new calls) to send."""
        self.text += delta
        parts, used = segments(self.text[self.done :], final)
        self.done += used
        content = "".join(p for p in parts if isinstance(p, str))
        return content, [p for p in parts if isinstance(p, tuple)]


def _start_prefix(text: str, pos: int) -> int:
    """Length of the longest tail of text[pos:] that is a proper prefix of START."""
    for k in range(min(len(START) - 1, len(text) - pos), 0, -1):
        if START.startswith(text[len(text) - k :]):
            return k
    return 0


def _call(body: str) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return value["name"], arguments
