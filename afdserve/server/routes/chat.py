"""/v1/chat/completions: the conversation through the chat template, answered as assistant
messages, or as tool calls (tools.py: forced by tool_choice, or read by a parser from a free
answer)."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from afdserve.engine.sampling_params import SamplingParams
from afdserve.server import convert, tools
from afdserve.server import protocol as api
from afdserve.server import responses as shape
from afdserve.server.engine_loop import Generation
from afdserve.server.engine_view import EngineView
from afdserve.server.limits import check_messages, check_text
from afdserve.server.protocol import APIError, bad_request
from afdserve.server.reasoned_tools import Reasoned
from afdserve.server.reasoning import ReasoningStream, split_reasoning
from afdserve.server.state import ServerState
from afdserve.server.streams import Logprobs, respond, start

Answering = tools.ToolChoice | tools.AutoTools | Reasoned | None


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/chat/completions")
    async def chat_completions(body: api.ChatCompletionRequest, request: Request) -> Response:
        engine, view = state.ready()
        answering = check(body, state, view)
        prompt = await asyncio.to_thread(
            convert.chat_prompt,
            view,
            body.messages,
            chat_template=state.chat_template,
            tools=tools.template_tools(body),
            switches=convert.template_switches(body),
        )
        (prompt,) = convert.truncate_prompts(
            [prompt], body.truncate_prompt_tokens, view.max_model_len
        )
        params = sampling_params(body, view, prompt, answering)
        gen = await start(state, engine, "chat", convert.fan_out([prompt], params))
        head = shape.envelope("chat.completion", f"chatcmpl-{gen.ids[0][:24]}", state.model_name)
        names, top = view.token_names(body.return_tokens_as_token_ids), body.top_logprobs or 0

        def logprobs(token_ids: list[int], entries: list) -> dict:
            return shape.chat_logprobs(names, token_ids, entries, top)

        formatter = logprobs if body.logprobs else None
        return await reply(
            gen, request, body, head, answering, formatter, params.n, state.options.reasoning_parser
        )

    return routes


def check(body: api.ChatCompletionRequest, state: ServerState, view: EngineView) -> Answering:
    """What the request may ask before the chat template runs; then room for it. Returns how
    its tools are answered (tools.tool_choice)."""
    state.check_model(body.model)
    convert.check_fields(body)
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs: needs logprobs: true", "top_logprobs")
    check_messages(body.messages, state.max_prompt_chars(view))
    check_text(body.stop, "stop")
    options = state.options
    parser = options.tool_call_parser if options.enable_auto_tool_choice else None
    answering = tools.tool_choice(body, parser)
    if answering is not None and options.reasoning_parser is not None:
        answering = Reasoned(answering, options.reasoning_parser)  # calls only after thinking
    state.admission.check(1)
    return answering


def sampling_params(
    body: api.ChatCompletionRequest, view: EngineView, prompt: list[int], answering: Answering
) -> SamplingParams:
    requested = body.max_completion_tokens
    if requested is None:
        requested = body.max_tokens
    # Unset: as much as fits; the engine refuses a prompt that fills the context.
    default = view.defaults.get("max_tokens")
    max_tokens = convert.max_tokens_for(requested, default, [prompt], view.max_model_len)
    logprobs_k = (body.top_logprobs or 0) if body.logprobs else None
    try:
        return convert.sampling_params(
            body,
            max_tokens,
            logprobs_k,
            view.vocab_size,
            view.model_dir,
            view.defaults,
            answering.constraint if answering else None,
        )
    except APIError as e:
        if e.param == "logprobs":  # the engine's name for what chat calls top_logprobs
            e.param, e.message = "top_logprobs", "top_" + e.message
        raise


async def reply(
    gen: Generation,
    request: Request,
    body: api.ChatCompletionRequest,
    head: dict,
    answering: Answering,
    formatter: Logprobs | None,
    n: int,
    parser: str | None = None,
) -> Response:
    """Assistant messages, or tool calls; streamed, each of the `n` choices opens with its
    role (or the tool call's start). `parser`: the reasoning parser, for plain answers."""
    if answering is not None:
        if not body.stream:
            return await respond(gen, request, body, head, answering.message, formatter)
        head = {**head, "object": "chat.completion.chunk"}
        stream = answering.stream()
        opening = stream.opening(head, n)
        return await respond(gen, request, body, head, stream.delta, formatter, opening)
    if parser is not None:
        return await reasoned(gen, request, body, head, formatter, n, parser)
    if not body.stream:
        return await respond(gen, request, body, head, shape.chat_choice, formatter)
    head = {**head, "object": "chat.completion.chunk"}

    def delta(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
        return shape.chat_choice(index, text, lp, finish, delta=True)

    return await respond(gen, request, body, head, delta, formatter, shape.role_chunks(head, n))


async def reasoned(
    gen: Generation,
    request: Request,
    body: api.ChatCompletionRequest,
    head: dict,
    formatter: Logprobs | None,
    n: int,
    parser: str,
) -> Response:
    """Plain answers through the reasoning parser: the thinking as `reasoning_content`, the
    rest as `content`; streamed, each as it settles (server/reasoning.py)."""
    if not body.stream:

        def message(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
            thinking, content = split_reasoning(text, parser)
            said = {"role": "assistant", "content": content, "reasoning_content": thinking}
            return shape.message_choice(index, said, lp, finish)

        return await respond(gen, request, body, head, message, formatter)
    head = {**head, "object": "chat.completion.chunk"}
    streams: dict[int, ReasoningStream] = {}

    def delta(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
        stream = streams.setdefault(index, ReasoningStream(parser))
        thinking, content = stream.feed(text, final=finish is not None)
        said = {k: v for k, v in (("reasoning_content", thinking), ("content", content)) if v}
        return shape.delta_choice(index, said, lp, finish)

    return await respond(gen, request, body, head, delta, formatter, shape.role_chunks(head, n))
