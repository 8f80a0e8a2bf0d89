"""OpenAI-compatible request bodies (pydantic) and the JSON shapes of responses and errors.

Requests ignore fields they do not know (clients send `user`, `metadata`, ...), so that a standard
client works; fields whose value would change the result in a way we cannot honour are refused.
"""

from __future__ import annotations

import re
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from afdserve.engine.engine_core import RequestOutput

TokenIds = list[StrictInt]


class StreamOptions(BaseModel):
    include_usage: bool = False


class SamplingFields(BaseModel):
    """Fields shared by completions and chat; `top_k` and `ignore_eos` are extensions."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = 16
    logprobs: int | None = None
    echo: bool = False


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


# ----- errors -----

ERROR_TYPES = {
    400: "invalid_request_error",
    404: "not_found_error",
    500: "internal_server_error",
    503: "service_unavailable",
}


def error_body(status: int, message: str, param: str | None = None, code: str | None = None):
    return {
        "error": {
            "message": message,
            "type": ERROR_TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class APIError(Exception):
    """An error the client gets as an OpenAI-style body with this HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param if param is not None else param_of(message))


# "SamplingParams.max_tokens=0: ..." (SamplingParams) or "prompt: ..." (RequestError).
_FIELD_PREFIX = re.compile(r"^(?:SamplingParams\.)?([A-Za-z_][A-Za-z_0-9 +]*?)(?:=[^:]*)?:")
_FIELD_ALIASES = {"prompt + max_tokens": "max_tokens"}


def param_of(message: str) -> str | None:
    """The request field an engine message names, or None."""
    match = _FIELD_PREFIX.match(message)
    if match is None:
        return None
    field = match.group(1)
    return _FIELD_ALIASES.get(field, field)


# pydantic's tags for the members of a union: they name types, not fields.
_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def field_path(loc: tuple | list) -> str:
    """'messages.0.content' from ('body', 'messages', 0, 'content', 'str')."""
    items = list(loc)
    if items and items[0] == "body":
        items = items[1:]
    parts: list[str] = []
    for item in items:
        if isinstance(item, int):
            parts.append(str(item))
        elif isinstance(item, str) and item.isidentifier() and item not in _UNION_TAGS:
            parts.append(item)
        else:
            break
    return ".".join(parts)


def validation_message(errors: list[dict]) -> tuple[str, str]:
    """(message, param) for FastAPI's validation errors, naming the first offending field."""
    if not errors:
        return "body: invalid request", "body"
    first = errors[0]
    if first.get("type") == "json_invalid":
        return f"body: not valid JSON ({first.get('msg')})", "body"
    path = field_path(first.get("loc", ())) or "body"
    message = f"{path}: {first.get('msg')}"
    others = {field_path(err.get("loc", ())) or "body" for err in errors[1:]} - {path}
    if others:
        message += f" (also: {', '.join(sorted(others))})"
    return message, path.split(".")[0]


# ----- responses -----


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
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
    decodes to U+FFFD; `bytes` keeps its real value where the tokenizer knows it."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer

    def text(self, token_id: int) -> str:
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


def finish_reason(out: RequestOutput) -> str | None:
    if not out.finished:
        return None
    return out.finish_reason if out.finish_reason in ("stop", "length") else "stop"


def completion_choice(index: int, text: str, logprobs: dict | None, finish: str | None) -> dict:
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def chat_choice(
    index: int, text: str, logprobs: dict | None, finish: str | None, delta: bool = False
) -> dict:
    if not delta:
        message = {"role": "assistant", "content": text}
        return {"index": index, "message": message, "logprobs": logprobs, "finish_reason": finish}
    content = {"content": text} if text else {}
    return {"index": index, "delta": content, "logprobs": logprobs, "finish_reason": finish}
