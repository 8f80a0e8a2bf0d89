"""Reasoning parsers (`--reasoning-parser`, vLLM's names): the model's thinking, written between
`<think>` and `</think>`, becomes the chat message's `reasoning_content`, the rest its `content`.

- `deepseek_r1`: DeepSeek-R1's template opens the think block in the prompt, so the answer
  usually starts inside it: everything up to `</think>` is reasoning (all of it while no
  `</think>` came), a leading `<think>` dropped.
- `qwen3`: Qwen3 writes both tags itself, and writes none with enable_thinking=false: an
  answer that opens with `<think>` reasons up to `</think>` (all of it, when cut before), any
  other answer is all content.

Streamed, a tail that could still become a tag waits for the next delta, so the streamed
reasoning and content add up to the whole answer's.
"""

from __future__ import annotations

START, END = "<think>", "</think>"
REASONING_PARSERS = ("deepseek_r1", "qwen3")


def split_reasoning(text: str, parser: str) -> tuple[str | None, str]:
    """(reasoning_content, content) of a whole answer; None when there is no reasoning."""
    opened = text.startswith(START)
    if parser == "qwen3" and not opened:
        return None, text
    body = text[len(START) :] if opened else text
    end = body.find(END)
    if end < 0:
        return body or None, ""
    return body[:end], body[end + len(END) :]


class ReasoningStream:
    """One streamed answer, fed its text deltas: (new reasoning, new content) to send."""

    def __init__(self, parser: str) -> None:
        self.parser = parser
        self.text = ""
        self.sent_reasoning = 0
        self.sent_content = 0

    def feed(self, delta: str, final: bool) -> tuple[str, str]:
        self.text += delta
        if final:
            reasoning, content = split_reasoning(self.text, self.parser)
            reasoning = reasoning or ""
        else:
            reasoning, content = self._so_far()
        new = reasoning[self.sent_reasoning :], content[self.sent_content :]
        self.sent_reasoning, self.sent_content = len(reasoning), len(content)
        return new

    def _so_far(self) -> tuple[str, str]:
        """What is settled: text that may still turn out to be part of a tag is held back."""
        text = self.text
        if START.startswith(text):  # "", "<", "<th", ... "<think>": nothing settled yet
            return "", ""
        if self.parser == "qwen3" and not text.startswith(START):
            return "", text  # no think block: all content, as it comes
        body = text[len(START) :] if text.startswith(START) else text
        end = body.find(END)
        if end >= 0:
            return body[:end], body[end + len(END) :]
        return body[: len(body) - _tag_prefix(body)], ""


def _tag_prefix(text: str) -> int:
    """Length of the longest tail of `text` that is a proper prefix of </think>."""
    for k in range(min(len(END) - 1, len(text)), 0, -1):
        if END.startswith(text[len(text) - k :]):
            return k
    return 0
