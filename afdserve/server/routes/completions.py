"""/v1/completions: prompts (text, token ids, or lists of either) -> n choices each, with vLLM's
echo, logprobs and best_of."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Request
from fastapi.responses import Response

from afdserve.engine.sampling_params import SamplingParams
from afdserve.server import convert
from afdserve.server import protocol as api
from afdserve.server import responses as shape
from afdserve.server.engine_view import EngineView
from afdserve.server.limits import check_prompt_chars, check_text
from afdserve.server.state import ServerState
from afdserve.server.streams import Choice, respond, start


def router(state: ServerState) -> APIRouter:
    routes = APIRouter()

    @routes.post("/v1/completions")
    async def completions(body: api.CompletionRequest, request: Request) -> Response:
        engine, view = state.ready()
        check(body, state, view)
        prompts = await asyncio.to_thread(convert.completion_prompts, view, body.prompt)
        prompts = convert.truncate_prompts(prompts, body.truncate_prompt_tokens, view.max_model_len)
        default = view.defaults.get("max_tokens", convert.COMPLETION_MAX_TOKENS)
        max_tokens = convert.max_tokens_for(body.max_tokens, default, prompts, view.max_model_len)
        params = convert.sampling_params(
            body, max_tokens, body.logprobs, view.vocab_size, view.model_dir, view.defaults
        )
        gen = await start(state, engine, "completion", convert.fan_out(prompts, params))
        head = shape.envelope("text_completion", f"cmpl-{gen.ids[0][:24]}", state.model_name)
        names = view.token_names(body.return_tokens_as_token_ids)

        def logprobs(token_ids: list[int], entries: list) -> dict:
            return shape.completion_logprobs(names, token_ids, entries, body.logprobs or 0)

        formatter = logprobs if body.logprobs is not None else None
        choice = shape.completion_choice
        if body.echo:
            choice = await echoing(view, prompts, params)
        echo_logprobs = bool(body.echo) and body.logprobs is not None
        return await respond(
            gen, request, body, head, choice, formatter, echo_logprobs=echo_logprobs
        )

    return routes


def check(body: api.CompletionRequest, state: ServerState, view: EngineView) -> None:
    """What the request may ask before any tokenizer runs; then room for its prompts."""
    state.check_model(body.model)
    convert.check_fields(body)
    check_text(body.prompt, "prompt")
    check_text(body.stop, "stop")
    check_prompt_chars(body.prompt, state.max_prompt_chars(view), "prompt")
    if body.prompt and isinstance(body.prompt, list):
        state.admission.check(len(body.prompt) if isinstance(body.prompt[0], str | list) else 1)
    else:
        state.admission.check(1)


async def echoing(view: EngineView, prompts: list[list[int]], params: SamplingParams) -> Choice:
    """echo: each choice's text starts with its prompt's (streamed: in its first chunk)."""
    echoes = await asyncio.to_thread(
        lambda: [view.tokenizer.decode(p, skip_special_tokens=False) for p in prompts]
    )
    echoed: set[int] = set()

    def choice(index: int, text: str, lp: dict | None, finish: str | None) -> dict:
        if index not in echoed:
            echoed.add(index)
            text = echoes[index // params.n] + text
        return shape.completion_choice(index, text, lp, finish)

    return choice
