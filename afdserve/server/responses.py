"""The JSON shapes of OpenAI-compatible responses: envelopes, choices, usage and logprobs."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from afdserve.frontend.outputs import SequenceOutput


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict[str, Any]:
    """OpenAI's usage; `cached_tokens`: prompt tokens served from the prefix cache."""
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }


def envelope(kind: str, response_id: str, model: str, created: int | None = None) -> dict:
    return {
        "id": response_id,
        "object": kind,
        "created": created if created is not None else int(time.time()),
        "model": model,
    }


class TokenText:
    """Token id -> text, for logprobs. A byte token that is part of a longer UTF-8 character
    decodes to U+FFFD; `bytes` keeps its real value where the tokenizer knows it.
    `as_token_ids` names every token "token_id:N" instead (vLLM's return_tokens_as_token_ids),
    which survives tokens whose text is not valid UTF-8 on its own."""

    def __init__(self, tokenizer: Any, as_token_ids: bool = False) -> None:
        self.tokenizer, self.as_token_ids = tokenizer, as_token_ids

    def text(self, token_id: int) -> str:
        if self.as_token_ids:
            return f"token_id:{token_id}"
        return self.tokenizer.decode([token_id])

    def bytes(self, token_id: int) -> list[int]:
        return list(self.text(token_id).encode("utf-8"))


def _top(entry: dict[int, float], k: int) -> list[tuple[int, float]]:
    # The engine's dict holds the sampled token plus the top k; the sampled one is only among
    # the top k if it ranks there.
    return sorted(entry.items(), key=lambda kv: -kv[1])[:k]


def completion_logprobs(
    names: TokenText, token_ids: list[int], entries: list[dict[int, float] | None], k: int
) -> dict:
    tokens, token_logprobs, top, offsets = [], [], [], []
    offset = 0
    for token_id, entry in zip(token_ids, entries):
        text = names.text(token_id)
        tokens.append(text)
        token_logprobs.append(entry.get(token_id) if entry else None)
        top.append({names.text(t): v for t, v in _top(entry, k)} if entry else None)
        offsets.append(offset)
        offset += len(text)
    return {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }


def chat_logprobs(
    names: TokenText, token_ids: list[int], entries: list[dict[int, float] | None], k: int
) -> dict:
    content = []
    for token_id, entry in zip(token_ids, entries):
        entry = entry or {}
        content.append(
            {
                "token": names.text(token_id),
                "logprob": entry.get(token_id, float("nan")),
                "bytes": names.bytes(token_id),
                "top_logprobs": [
                    {"token": names.text(t), "logprob": v, "bytes": names.bytes(t)}
                    for t, v in _top(entry, k)
                ],
            }
        )
    return {"content": content}


def prompt_logprobs(entries: list[dict[int, float] | None]) -> list[dict | None]:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id as a string:
    {"logprob", "rank", "decoded_token"}}."""
    return [
        None
        if entry is None
        else {
            str(t): {
                "logprob": float(v),
                "rank": getattr(v, "rank", None),
                "decoded_token": getattr(v, "decoded_token", None),
            }
            for t, v in entry.items()
        }
        for entry in entries
    ]


def finish_reason(out: SequenceOutput) -> str | None:
    if not out.finished:
        return None
    return out.finish_reason if out.finish_reason in ("stop", "length") else "stop"


def completion_choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(
    index: int, text: str, logprobs: dict | None, finish: str | None, delta: bool = False
) -> dict:
    if not delta:
        return message_choice(index, {"role": "assistant", "content": text}, logprobs, finish)
    return delta_choice(index, {"content": text} if text else {}, logprobs, finish)


def message_choice(index: int, message: dict, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}


def delta_choice(index: int, delta: dict, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}


def role_chunks(head: dict, n: int, first: Callable[[], dict] | None = None) -> tuple[dict, ...]:
    """The opening chunk of each of `n` streamed chat choices: the role, and what `first()`
    gives instead of the empty content."""
    make = first or (lambda: {"role": "assistant", "content": ""})
    return tuple({**head, "choices": [delta_choice(i, make(), None, None)]} for i in range(n))
