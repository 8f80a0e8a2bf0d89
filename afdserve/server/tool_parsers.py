"""Tool-call parsers for `tool_choice: "auto"`: the model calls in its own format, and the server
turns that text into OpenAI's `tool_calls`; vLLM's parsers of the same names, as models write them:

- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.
- `qwen3_coder` (Qwen3-Coder): `<tool_call><function=NAME><parameter=KEY>VALUE</parameter>...
  </function></tool_call>`.
- `deepseek_v3` (DeepSeek-V3, R1): inside `<｜tool▁calls▁begin｜>...<｜tool▁calls▁end｜>`, each
  `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME` then the arguments in a ```json fence, then
  `<｜tool▁call▁end｜>`.
- `kimi_k2` (Kimi-K2): inside `<|tool_calls_section_begin|>...<|tool_calls_section_end|>`, each
  `<|tool_call_begin|>functions.NAME:INDEX<|tool_call_argument_begin|>{...}<|tool_call_end|>`.

Everything else is the message's content, a block that is not a valid call included, markers
and all: nothing the model wrote is dropped, except the section markers around the calls. One
segmentation (`segments`) serves whole and streamed answers (`ToolCallStream`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from dataclasses import dataclass

Call = tuple[str, str]  # name, arguments (JSON text)
Segment = str | Call  # content, or a call


@dataclass(frozen=True)
class ToolFormat:
    start: str  # opens one call
    end: str  # closes it (the last one may be left open at the end of the answer)
    read: Callable[[str], Call | None]  # the call between them, or None: not a call
    sections: tuple[str, ...] = ()  # markers around the calls, dropped from the content

    @property
    def markers(self) -> tuple[str, ...]:
        return (self.start, *self.sections)


def _arguments(value: object) -> str:
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


def _json_object(text: str) -> str | None:
    try:
        value = json.loads(text)
    except ValueError:
        return None
    return _arguments(value) if isinstance(value, dict) else None


def _hermes(body: str) -> Call | None:
    try:
        value = json.loads(body)
    except ValueError:
        return None
    if not (isinstance(value, dict) and isinstance(value.get("name"), str)):
        return None
    return value["name"], _arguments(value.get("arguments", value.get("parameters", {})))


_QWEN_FUNCTION = re.compile(r"^\s*<function=([^>\s]+)>(.*)</function>\s*$", re.DOTALL)
_QWEN_PARAMETER = re.compile(r"<parameter=([^>\s]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _qwen3_coder(body: str) -> Call | None:
    """A value that reads as JSON (a number, true, an object) is that value, anything else a
    string (vLLM converts by the tool's schema, which this parser does not see)."""
    match = _QWEN_FUNCTION.match(body)
    if match is None:
        return None
    name, inner = match.groups()
    arguments = {}
    for key, raw in _QWEN_PARAMETER.findall(inner):
        try:
            arguments[key] = json.loads(raw)
        except ValueError:
            arguments[key] = raw
    if _QWEN_PARAMETER.sub("", inner).strip():
        return None  # text outside the parameters: not the format
    return name, json.dumps(arguments, ensure_ascii=False)


_DEEPSEEK_CALL = re.compile(
    r"^\s*(?:function)?<｜tool▁sep｜>([^\n]+)\n```(?:json)?\n(.*)\n```\s*$", re.DOTALL
)


def _deepseek_v3(body: str) -> Call | None:
    match = _DEEPSEEK_CALL.match(body)
    arguments = _json_object(match.group(2)) if match else None
    return None if arguments is None else (match.group(1).strip(), arguments)  # type: ignore[union-attr]


_KIMI_CALL = re.compile(
    r"^\s*(?:functions\.)?([^\s:<]+)(?::\d+)?\s*<\|tool_call_argument_begin\|>(.*)$", re.DOTALL
)


def _kimi_k2(body: str) -> Call | None:
    match = _KIMI_CALL.match(body)
    arguments = _json_object(match.group(2)) if match else None
    return None if arguments is None else (match.group(1), arguments)  # type: ignore[union-attr]


FORMATS: dict[str, ToolFormat] = {
    "hermes": ToolFormat("<tool_call>", "</tool_call>", _hermes),
    "qwen3_coder": ToolFormat("<tool_call>", "</tool_call>", _qwen3_coder),
    "deepseek_v3": ToolFormat(
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        _deepseek_v3,
        ("<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"),
    ),
    "kimi_k2": ToolFormat(
        "<|tool_call_begin|>",
        "<|tool_call_end|>",
        _kimi_k2,
        ("<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"),
    ),
}
PARSERS = tuple(FORMATS)
START, END = FORMATS["hermes"].start, FORMATS["hermes"].end


def segments(
    text: str, final: bool, fmt: ToolFormat = FORMATS["hermes"]
) -> tuple[list[Segment], int]:
    """The content pieces and calls of `text` in order, and how many characters they cover."""
    out: list[Segment] = []
    pos = 0

    def content(piece: str) -> None:
        for marker in fmt.sections:
            piece = piece.replace(marker, "")
        if piece:
            out.append(piece)

    while pos < len(text):
        start = text.find(fmt.start, pos)
        if start < 0:
            end = len(text) if final else len(text) - _marker_prefix(text, pos, fmt.markers)
            if end > pos:
                content(text[pos:end])
            return out, end
        if start > pos:
            content(text[pos:start])
        close = text.find(fmt.end, start + len(fmt.start))
        if close < 0 and not final:
            return out, start
        body_end = len(text) if close < 0 else close
        stop = len(text) if close < 0 else close + len(fmt.end)
        found = fmt.read(text[start + len(fmt.start) : body_end])
        out.append(found if found is not None else text[start:stop])
        pos = stop
    return out, pos


def parse_calls(text: str, parser: str = "hermes") -> tuple[str, list[Call]]:
    """(content, calls) of a whole answer."""
    parts, _ = segments(text, final=True, fmt=FORMATS[parser])
    content = "".join(p for p in parts if isinstance(p, str))
    return content, [p for p in parts if isinstance(p, tuple)]


def parse_hermes(text: str) -> tuple[str, list[Call]]:
    return parse_calls(text, "hermes")


class ToolCallStream:
    """One streamed answer, fed its text deltas. The segmentation runs on what has not been sent
    yet and leaves for later what may still change: a tail that could be the start of a marker
    and a block not closed yet. So the streamed content adds up to the whole answer's content
    and the streamed calls are the whole answer's calls."""

    def __init__(self, parser: str = "hermes") -> None:
        self.fmt = FORMATS[parser]
        self.text = ""
        self.done = 0  # characters already turned into segments

    def feed(self, delta: str, final: bool) -> tuple[str, list[Call]]:
        """(new content, new calls) to send."""
        self.text += delta
        parts, used = segments(self.text[self.done :], final, self.fmt)
        self.done += used
        content = "".join(p for p in parts if isinstance(p, str))
        return content, [p for p in parts if isinstance(p, tuple)]


HermesStream = ToolCallStream


def _marker_prefix(text: str, pos: int, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of text[pos:] that is a proper prefix of a marker."""
    longest = max(len(m) for m in markers)
    for k in range(min(longest - 1, len(text) - pos), 0, -1):
        tail = text[len(text) - k :]
        if any(m.startswith(tail) and len(m) > k for m in markers):
            return k
    return 0
