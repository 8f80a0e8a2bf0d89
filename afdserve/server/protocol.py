"""OpenAI-compatible request bodies (pydantic) and the OpenAI-style errors.

Every field a request may carry is in one of three groups: honoured (a model field below),
refused with a 400 that names it (`UNSUPPORTED`: it would change the answer in a way we cannot
honour), or ignored because it cannot change the answer (`IGNORED`). Anything else is unknown:
it is ignored too, like vLLM, but logged with its name.
"""

from __future__ import annotations

import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt

from afdserve.engine.sampling_params import SEED_MAX, SEED_MIN

TokenIds = list[StrictInt]

# Field -> the values that are harmless (the default meaning); any other value is refused.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    # Chat declares these (server/tools.py); on completions they mean nothing we could honour.
    "tools": (None, []),
    "tool_choice": (None, "none"),
    "functions": (None, []),
    "function_call": (None, "none"),
    "suffix": (None, ""),
    "audio": (None,),
    "modalities": (None, ["text"]),
    "prediction": (None,),
    "add_special_tokens": (None, False),
    "echo": (None, False),
    # vLLM's fields that change the answer in ways this server does not implement.
    "use_beam_search": (None, False),
    "length_penalty": (None, 1, 1.0),
    "spaces_between_special_tokens": (None, True),
    "logits_processors": (None, []),
    "vllm_xargs": (None, {}),
    "documents": (None, []),
    "mm_processor_kwargs": (None, {}),
    "chat_template": (None,),  # per request: vLLM refuses it unless trusted; --chat-template
    "reasoning_effort": (None,),
    "kv_transfer_params": (None,),
    "guided_whitespace_pattern": (None,),
}
# Fields that cannot change the generated text: accepted without a warning.
IGNORED = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "priority",
        "request_id",
        "guided_decoding_backend",
        "cache_salt",
    }
)


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class StructuredOutputs(BaseModel):
    """vLLM's `structured_outputs`: exactly one constraint. `disable_fallback` and
    `disable_any_whitespace` change nothing here (one grammar backend; JSON is always compact)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)

    json_schema: dict[str, Any] | str | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    disable_fallback: bool | None = None
    disable_any_whitespace: bool | None = None


class SamplingFields(BaseModel):
    """Fields shared by completions and chat. `None` means "the default", as OpenAI clients may
    send null. Beyond OpenAI's fields, vLLM's extensions: `top_k`, `min_p`, `min_tokens`,
    `repetition_penalty`, `stop_token_ids`, `ignore_eos`, `skip_special_tokens`,
    `include_stop_str_in_output`, `return_token_ids`, `truncate_prompt_tokens`,
    `structured_outputs` and the older `guided_*`, `bad_words`, `allowed_token_ids`,
    `return_tokens_as_token_ids`."""

    model_config = ConfigDict(extra="allow")

    model: str | None = None
    n: int | None = None
    best_of: int | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[StrictInt] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    seed: int | None = Field(default=None, ge=SEED_MIN, le=SEED_MAX)
    ignore_eos: bool | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    logit_bias: dict[str, float] | None = None
    response_format: dict[str, Any] | None = None
    skip_special_tokens: bool | None = None
    include_stop_str_in_output: bool | None = None
    return_token_ids: bool | None = None
    truncate_prompt_tokens: int | None = Field(default=None, ge=-1)
    # vLLM's output constraints: the current field, and the older guided_* ones.
    structured_outputs: StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    bad_words: list[str] | None = None
    allowed_token_ids: list[StrictInt] | None = None
    # Logprobs name their tokens "token_id:N" rather than by text (vLLM's field).
    return_tokens_as_token_ids: bool | None = None
    # The prompt's logprobs: the top N at every prompt token (vLLM's field; `prompt_logprobs`
    # per choice on completions, once per response on chat).
    prompt_logprobs: int | None = None

    def unknown_fields(self) -> list[str]:
        return sorted(set(self.model_extra or ()) - set(UNSUPPORTED) - IGNORED)

    def unsupported_field(self) -> str | None:
        """The first field set to a value we cannot honour, or None."""
        extra = self.model_extra or {}
        for name, harmless in UNSUPPORTED.items():
            if name in extra and extra[name] not in harmless:
                return name
        return None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | TokenIds | list[TokenIds]
    max_tokens: int | None = None
    logprobs: int | None = None
    # The prompt's text before each choice's (chat refuses it); with logprobs, the prompt's
    # tokens and logprobs before the choice's too (what lm-eval's loglikelihood reads).
    echo: bool | None = None


class ContentPart(BaseModel):
    model_config = ConfigDict(extra="ignore")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")

    role: str
    content: str | list[ContentPart] | None = None
    # An assistant turn's calls and a tool turn's answer, for templates that render them.
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None
    name: str | None = None

    def turn(self) -> dict[str, Any]:
        """The message as chat templates read it."""
        extra = {
            "tool_calls": self.tool_calls,
            "tool_call_id": self.tool_call_id,
            "name": self.name,
        }
        return {
            "role": self.role,
            "content": self.text(),
            **{k: v for k, v in extra.items() if v is not None},
        }

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="ignore")

    name: str = Field(pattern=r"^[A-Za-z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class FunctionName(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionName


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # False: "required" makes exactly one call
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = None
    # The chat template's switches, passed to it as they are (vLLM's fields): extra variables
    # (Qwen3's enable_thinking), the assistant turn's opening, or continuing the last message.
    chat_template_kwargs: dict[str, Any] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False


class TokenizeRequest(BaseModel):
    """vLLM's /tokenize: a prompt, or chat messages rendered through the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_generation_prompt: bool = True
    add_special_tokens: bool = False


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: TokenIds


# ----- errors -----

ERROR_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    404: "not_found_error",
    413: "request_too_large",
    500: "internal_server_error",
    503: "service_unavailable",
    504: "timeout",
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
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
        rejected: str | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        # Why the server refused to run the request (afdserve_requests_rejected_total's reason),
        # when it refused it as a server: overload, draining, engine down. None for client errors.
        self.headers, self.rejected = headers, rejected

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)


def overloaded(message: str, retry_after_s: int, reason: str) -> APIError:
    """503 with Retry-After: the server is busy (or draining); the client may try again."""
    headers = {"Retry-After": str(retry_after_s)}
    return APIError(503, message, code="overloaded", headers=headers, rejected=reason)


# Clients see one line of an internal error; its traceback (rank tracebacks name source files)
# stays in the server log.
_TRACE_MARKERS = re.compile(r"Traceback|File \"|\.py\b")


def public_message(text: str) -> str:
    """The first line of an internal error, without anything that looks like a traceback."""
    first = text.strip().splitlines()[0] if text.strip() else "internal error"
    first = first.rstrip(":").strip()
    if _TRACE_MARKERS.search(first):
        return "internal error (details are in the server log)"
    return first


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
