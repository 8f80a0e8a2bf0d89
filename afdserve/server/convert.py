"""HTTP request -> engine requests: field checks, prompts, max_tokens against the context, and one
SamplingParams per engine sequence (n choices, or best_of candidates, per prompt)."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from afdserve.engine.sampling_params import SamplingParams, candidate_params
from afdserve.engine.structured import StructuredOutputsParams
from afdserve.server import protocol as api
from afdserve.server.logs import few
from afdserve.server.protocol import bad_request, public_message

if TYPE_CHECKING:
    from afdserve.server.engine_view import EngineView

log = logging.getLogger("afdserve.server")

MAX_CHOICES = 128  # engine sequences one HTTP request may start (prompts x best_of)
COMPLETION_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def check_fields(body: api.SamplingFields) -> None:
    """Refuse what we cannot honour; log what we do not know (it is ignored, as by vLLM)."""
    field = body.unsupported_field()
    if field is not None:
        value = (body.model_extra or {})[field]
        raise bad_request(f"{field}: {value!r} is not supported by this server", field)
    unknown = body.unknown_fields()
    if unknown:
        log.warning("request fields not recognised and ignored: %s", few(unknown))
    if body.stream_options is not None and not body.stream:
        raise bad_request("stream_options: only allowed with stream: true", "stream_options")


def completion_prompts(engine: EngineView, prompt: Any) -> list[list[int]]:
    if isinstance(prompt, str):
        return [engine.encode(prompt)]
    if prompt and isinstance(prompt[0], (str, list)):
        return [engine.encode(p) for p in prompt]
    return [list(prompt)]


# Arguments of apply_chat_template itself: chat_template_kwargs may not set them.
TEMPLATE_ARGUMENTS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def template_switches(body: api.ChatCompletionRequest) -> dict[str, Any]:
    """The request's add_generation_prompt, continue_final_message and chat_template_kwargs,
    as apply_chat_template's keywords; a combination the template cannot honour is a 400."""
    if body.continue_final_message and body.add_generation_prompt:
        raise bad_request(
            "continue_final_message: cannot be combined with "
            "add_generation_prompt: true; set that to false",
            "continue_final_message",
        )
    if body.continue_final_message and body.messages[-1].role != "assistant":
        raise bad_request(
            "continue_final_message: the last message must be the assistant's "
            f"to continue, not {body.messages[-1].role!r}",
            "continue_final_message",
        )
    extra = dict(body.chat_template_kwargs or {})
    clash = sorted(TEMPLATE_ARGUMENTS & set(extra))
    if clash:
        raise bad_request(
            f"chat_template_kwargs: {clash[0]!r} is an argument of the chat "
            "template's call, not a template variable",
            "chat_template_kwargs",
        )
    return {
        **extra,
        "add_generation_prompt": body.add_generation_prompt,
        "continue_final_message": body.continue_final_message,
    }


def chat_prompt(
    engine: EngineView,
    messages: list[api.ChatMessage],
    add_generation_prompt: bool = True,
    chat_template: str | None = None,
    tools: list[dict] | None = None,
    switches: dict[str, Any] | None = None,
) -> list[int]:
    """The conversation (and the tools, for templates that show them to the model) through
    `chat_template` (the server's --chat-template), else the tokenizer's own template.
    `switches` (template_switches) replace add_generation_prompt when given."""
    turns = [m.turn() for m in messages]
    switches = switches or {"add_generation_prompt": add_generation_prompt}
    try:
        text = engine.tokenizer.apply_chat_template(
            turns,
            chat_template=chat_template,
            tokenize=False,
            **switches,
            **({"tools": tools} if tools else {}),
        )
    except Exception as e:  # the template refuses this conversation (roles, order, ...)
        # Its first line only: the exception may be any of the template's, reprs included.
        reason = public_message(str(e))[:300]
        raise bad_request(
            f"messages: the chat template refused them: {reason}", "messages"
        ) from None
    return engine.encode(text)


def truncate_prompts(
    prompts: list[list[int]], keep: int | None, max_model_len: int
) -> list[list[int]]:
    """vLLM's truncate_prompt_tokens: keep each prompt's last `keep` tokens (-1: as many as
    max_model_len). More than max_model_len is a 400: no prompt that long could run."""
    if keep is None:
        return prompts
    if keep == -1:
        keep = max_model_len
    if keep == 0 or keep > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens: {keep}; allowed: -1 (max_model_len) or 1..{max_model_len}",
            "truncate_prompt_tokens",
        )
    return [p[-keep:] for p in prompts]


def max_tokens_for(
    requested: int | None, default: int | None, prompts: list[list[int]], max_model_len: int
) -> int:
    """An explicit max_tokens that does not fit beside the longest prompt is refused (vLLM's
    rule); the default shrinks to the room left. A prompt that fills the context is left to the
    engine, which names the prompt."""
    longest = max(len(p) for p in prompts)
    room = max_model_len - longest
    if requested is None:
        return max(1, room if default is None else min(default, room))
    if room > 0 and requested > room:
        raise bad_request(
            f"max_tokens: {requested} tokens do not fit: the context holds {max_model_len} tokens "
            f"and the prompt takes {longest}, which leaves {room}",
            "max_tokens",
        )
    return requested


# vLLM's older per-kind fields -> the StructuredOutputsParams field each fills.
GUIDED = {
    "guided_json": "json",
    "guided_regex": "regex",
    "guided_choice": "choice",
    "guided_grammar": "grammar",
}


def structured_outputs(
    body: api.SamplingFields, tokenizer_dir: str, tool_constraint: dict[str, Any] | None = None
) -> tuple[StructuredOutputsParams | None, str]:
    """The request's output constraint and the field that carried it: OpenAI's
    response_format, vLLM's structured_outputs, or vLLM's older guided_json / guided_regex /
    guided_choice / guided_grammar, or a forced tool call (`tool_constraint`, the
    StructuredOutputsParams fields of server/tools.py or reasoned_tools.py). More than one
    is a 400, as is a grammar that does not compile; every message names the field the
    request used."""
    constraints = {
        "response_format": _response_format(body.response_format),
        "structured_outputs": _structured(body.structured_outputs),
    }
    for name, kind in GUIDED.items():
        value = getattr(body, name)
        constraints[name] = {} if value is None else {kind: value}
    constraints["tool_choice"] = tool_constraint or {}
    given = [name for name, kwargs in constraints.items() if kwargs]
    if not given:
        return None, ""
    name, *others = given
    if others:
        raise bad_request(
            f"{others[0]}: cannot be combined with {name}; give one output constraint", others[0]
        )
    try:
        params = StructuredOutputsParams(**constraints[name], tokenizer_dir=tokenizer_dir)
        params.check()
    except ValueError as e:
        message = str(e).removeprefix("StructuredOutputsParams").lstrip(".: ")
        raise bad_request(f"{name}: {message}", name) from None
    return params, name


def _response_format(response_format: dict[str, Any] | None) -> dict[str, Any]:
    """OpenAI's response_format: text (no constraint), json_object, or json_schema."""
    kind = (response_format or {}).get("type", "text")
    if kind == "text":
        return {}
    if kind == "json_object":
        return {"json_object": True}
    if kind == "json_schema":
        spec = response_format.get("json_schema")  # type: ignore[union-attr]
        schema = spec.get("schema") if isinstance(spec, dict) else None
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format: json_schema needs json_schema.schema, an object",
                "response_format",
            )
        return {"json": schema}
    allowed = "text, json_object or json_schema"
    raise bad_request(f"response_format: type {kind!r}; allowed: {allowed}", "response_format")


def _structured(fields: api.StructuredOutputs | None) -> dict[str, Any]:
    if fields is None:
        return {}
    kwargs = {
        "json": fields.json_schema,
        "regex": fields.regex,
        "choice": fields.choice,
        "grammar": fields.grammar,
        "json_object": bool(fields.json_object),
    }
    kwargs = {k: v for k, v in kwargs.items() if v not in (None, False)}
    if not kwargs:
        raise bad_request(
            "structured_outputs: give one of json, regex, choice, grammar, json_object",
            "structured_outputs",
        )
    return kwargs


def sampling_params(
    body: api.SamplingFields,
    max_tokens: int,
    logprobs: int | None,
    vocab_size: int,
    tokenizer_dir: str = "",
    defaults: Mapping[str, Any] | None = None,
    tool_constraint: dict[str, Any] | None = None,
) -> SamplingParams:
    """The request's SamplingParams; every bound is SamplingParams' own (named in the 400).
    `defaults` (frontend/generation_config.py, from --generation-config) fill the fields the
    request left out."""
    fields: dict[str, Any] = {
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "stop": body.stop or (),
        "stop_token_ids": tuple(body.stop_token_ids or ()),
    }
    for name in (
        "n",
        "best_of",
        "temperature",
        "top_p",
        "top_k",
        "min_p",
        "seed",
        "ignore_eos",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "skip_special_tokens",
        "include_stop_str_in_output",
        "bad_words",
        "allowed_token_ids",
        "prompt_logprobs",
    ):
        value = getattr(body, name)
        if value is None and defaults:
            value = defaults.get(name)
        if value is not None:
            fields[name] = value
    if getattr(body, "echo", None) and logprobs is not None:
        # echo with logprobs: the prompt's tokens carry logprobs like the answer's (vLLM's rule).
        fields["prompt_logprobs"] = max(fields.get("prompt_logprobs") or 0, logprobs)
    if body.logit_bias:
        fields["logit_bias"] = logit_bias(body.logit_bias)
    fields["structured_outputs"], constraint = structured_outputs(
        body, tokenizer_dir, tool_constraint
    )
    try:
        params = SamplingParams(**fields)
        params.check_vocab(vocab_size)
    except ValueError as e:
        message = str(e).removeprefix("SamplingParams.")
        if message.startswith("structured_outputs"):  # what the request called it
            message = f"{constraint}:{message.split(':', 1)[1]}"
            raise bad_request(message, constraint) from None
        raise bad_request(message) from None
    if body.stream and params.candidates > params.n:
        raise bad_request("best_of: must equal n when streaming", "best_of")
    return params


def logit_bias(raw: dict[str, float]) -> dict[int, float]:
    """JSON object keys are strings: {"50256": -100}."""
    try:
        return {int(token): value for token, value in raw.items()}
    except ValueError:
        raise bad_request("logit_bias: keys must be token ids (integers)", "logit_bias") from None


@dataclass(frozen=True)
class Fanout:
    """The engine sequences behind one HTTP request, prompt-major: `candidates` per prompt."""

    prompts: list[list[int]]
    params: list[SamplingParams]
    n: int
    candidates: int


def fan_out(prompts: list[list[int]], params: SamplingParams) -> Fanout:
    count = params.candidates
    if count * len(prompts) > MAX_CHOICES:
        field = "best_of" if params.best_of is not None else "n"
        allowed = f"{field} x prompts <= {MAX_CHOICES}"
        raise bad_request(f"{field}: {count} for {len(prompts)} prompt(s); allowed: {allowed}")
    return Fanout(
        prompts=[p for p in prompts for _ in range(count)],
        params=candidate_params(params) * len(prompts),
        n=params.n,
        candidates=count,
    )
